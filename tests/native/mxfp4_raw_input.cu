// ffi/cuda_mxfp4.h's raw-input helpers (MaxMagnitude, ScaleExponent, Pow2, ToLanes) run on the CPU, row by row, as
// the CUDA kernels run them on a CTA's copy of their input: tests/test_kernels.py compiles this with nvcc and checks
// the output against `moe_experts.f16_scaled` and `mxfp4_cuda.lanes_order`.
//   mxfp4_raw_input IN OUT
// IN: int32 R, int32 N (a multiple of 8), then R x N bf16 bit patterns (uint16).  OUT: per row int32 k and the row's N
// float16 bit patterns in the lanes' order (each 8 permuted [0, 4, 2, 6, 1, 5, 3, 7]), times 2^k.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_mxfp4.h"

int main(int argc, char** argv) {
  using namespace jaxk3::mxfp4;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  int32_t R = 0, N = 0;
  if (!in || !out || std::fread(&R, 4, 1, in) != 1 || std::fread(&N, 4, 1, in) != 1 || R < 0 || N < 8 || N % 8) {
    std::fprintf(stderr, "%s: cannot read a header of R and N (a multiple of 8) from %s\n", argv[0], argv[1]);
    return 2;
  }
  std::vector<uint4> row(N / 8);
  for (int32_t r = 0; r < R; ++r) {
    if (std::fread(row.data(), 16, row.size(), in) != row.size()) {
      std::fprintf(stderr, "%s: row %d is short\n", argv[0], r);
      return 2;
    }
    uint32_t m = 0;
    for (const uint4& v : row) m = MaxMagnitude(v, m);
    const int32_t k = ScaleExponent(m);
    const float s = Pow2(k);
    for (uint4& v : row) v = ToLanes(v, s);
    std::fwrite(&k, 4, 1, out);
    std::fwrite(row.data(), 16, row.size(), out);
  }
  return std::fclose(out) == 0 ? 0 : 1;
}
