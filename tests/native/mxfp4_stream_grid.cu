// ffi/cuda_mxfp4.h's StreamGrid (the streaming kernels' persistent grid) run on the CPU: tests/test_kernels.py compiles
// this with nvcc and checks its grids.  Reads lines "items fit cap" from stdin and writes each grid on its own line.
#include <cstdio>

#include "cuda_mxfp4.h"

int main() {
  long long items = 0, fit = 0, cap = 0;
  while (std::scanf("%lld %lld %lld", &items, &fit, &cap) == 3) std::printf("%lld\n", jaxk3::mxfp4::StreamGrid(items, fit, cap));
  return 0;
}
