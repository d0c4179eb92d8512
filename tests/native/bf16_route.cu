// ffi/cuda_bf16_route.h (jaxk3_bf16_gate_up's routing) run on the CPU: tests/test_kernels.py compiles this with nvcc
// and checks its choices against router.select_experts.  Reads cases "E k renorm scale" then E logits and E biases
// (hexadecimal float32 bits); writes each case's k experts, then their k weights' bits, on one line.
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_bf16_route.h"

static float FromBits(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

int main() {
  int E = 0, k = 0, renorm = 0;
  unsigned scale_bits = 0;
  while (std::scanf("%d %d %d %x", &E, &k, &renorm, &scale_bits) == 4) {
    std::vector<float> s(E), c(E);
    std::vector<unsigned> lg(E), bias(E);
    for (int j = 0; j < E; ++j) std::scanf("%x", &lg[j]);
    for (int j = 0; j < E; ++j) std::scanf("%x", &bias[j]);
    for (int j = 0; j < E; ++j) {  // as the kernel's threads do, one expert each
      s[j] = jaxk3::bf16route::Sigmoid(FromBits(lg[j]));
      c[j] = s[j] + FromBits(bias[j]);
    }
    std::vector<int> ids(k, INT_MAX);
    std::vector<float> coef(k);
    for (int j = 0; j < E; ++j) {
      const int rank = jaxk3::bf16route::Rank(c.data(), E, j);
      if (rank < k && j < ids[rank]) ids[rank] = j;  // the kernel's atomicMin
    }
    jaxk3::bf16route::Settle(ids.data(), coef.data(), s.data(), k, renorm != 0, FromBits(scale_bits));
    for (int u = 0; u < k; ++u) std::printf("%d ", ids[u]);
    for (int u = 0; u < k; ++u) {
      unsigned b;
      std::memcpy(&b, &coef[u], sizeof b);
      std::printf("%08x ", b);
    }
    std::printf("\n");
  }
  return 0;
}
