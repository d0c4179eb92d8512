// The router's selection for one token as jaxk3_bf16_gate_up's CTAs make it (ffi/cuda_bf16_experts.cu), in host and
// device code: tests/native/bf16_route.cu runs these on the CPU against `router.select_experts`.  The arithmetic is
// select_experts': s = sigmoid(logit), the selection score s + bias, the k best in lax.top_k's order (larger first, the
// lower index first among equal scores), their weights s / (Σ s + 1e-20) · scale (or s · scale), summed in slot order.
#pragma once

#include <climits>
#include <cmath>

namespace jaxk3 {
namespace bf16route {

__host__ __device__ inline float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Expert j's place in lax.top_k's order of the E selection scores c: the experts before it.  Expert j fills slot
// Rank(...) when that is < k; NaN scores compare false both ways, so two experts can share a place and a place can be
// left empty: `Settle` resolves both.
__host__ __device__ inline int Rank(const float* c, int E, int j) {
  const float cj = c[j];
  int rank = 0;
  for (int i = 0; i < E; ++i) {
    const float ci = c[i];
    rank += (ci > cj) | ((ci == cj) & (i < j));
  }
  return rank;
}

// The slots' experts after every expert of rank < k has offered itself (ids[rank] = the lowest such index, INT_MAX where
// none did: NaN scores), and their weights from s.  A slot no expert took reads expert 0.
__host__ __device__ inline void Settle(int* ids, float* coef, const float* s, int k, bool renorm, float scale) {
  float sum = 0.0f;
  for (int u = 0; u < k; ++u) {
    if (ids[u] == INT_MAX) ids[u] = 0;
    sum += s[ids[u]];
  }
  for (int u = 0; u < k; ++u) coef[u] = (renorm ? s[ids[u]] / (sum + 1e-20f) : s[ids[u]]) * scale;
}

}  // namespace bf16route
}  // namespace jaxk3
