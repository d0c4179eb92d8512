"""The tools around the model: benchmarks (bench_gather, bench_decode, bench_generate,
bench_kernels), the kernel census, the memory report and the demo.  They import the product
(jaxk3, jaxk3.collectives, jaxk3.kernels and the layers below them); nothing in the product imports
them (tests/test_architecture.py)."""
