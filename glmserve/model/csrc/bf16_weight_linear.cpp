// A float32 linear x @ W.T over weights stored as bfloat16, for the few rows of a decode or verification
// step. The checkpoint's weights are bfloat16: a float32 model holds them exactly, in twice the bytes. At
// 8-32 rows a step's products are bound by reading the weights (~44 MB a step on the bundled model, more
// than the L3 of a small CPU), so reading half the bytes is most of their time. The products are the same
// float32 products of the same values, summed k = 0, 1, ... with fused multiply-adds: a row's result
// differs from oneDNN's float32 GEMM in the last bits only, and depends on nothing else in the call.
//
// Layout (pack_bf16_weight): the weight [N, K] as [ceil(N / 16), K, 16] bfloat16, sixteen output columns
// per K-row, zeros past N: the kernel streams each 16-column panel once per four input rows.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bfloat16_bits.h"
#include "float_vectors.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two registers of eight floats
constexpr int64_t kRows = 4;    // input rows per pass over a panel: 8 accumulators

using glmserve::broadcast;
using glmserve::fma;
using glmserve::Floats;

// Eight bfloat16 values widened to float32 (the bits shifted into the high half).
inline Floats widen8(const uint16_t* p) {
#ifdef __AVX2__
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (Floats)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  Floats v;
  for (int i = 0; i < 8; ++i) v[i] = glmserve::widen(p[i]);
  return v;
#endif
}

// out[r, n0 + j] for R rows and one panel.
template <int R>
void panel_rows(const float* x, int64_t k_size, const uint16_t* panel, int64_t n0, int64_t n_size, float* out) {
  Floats lo[R], hi[R];  // registers: the loops over r unroll
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = Floats{};
  for (int64_t k = 0; k < k_size; ++k) {
    const Floats w_lo = widen8(panel + k * kPanel), w_hi = widen8(panel + k * kPanel + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Floats xr = broadcast(x[r * k_size + k]);
      lo[r] = fma(xr, w_lo, lo[r]);
      hi[r] = fma(xr, w_hi, hi[r]);
    }
  }
  const int64_t width = std::min(kPanel, n_size - n0);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float values[kPanel];
    const Floats l = lo[r], h = hi[r];  // copies: the accumulators' own addresses are never taken
    std::memcpy(values, &l, sizeof l);
    std::memcpy(values + 8, &h, sizeof h);
    std::memcpy(out + r * n_size + n0, values, width * sizeof(float));
  }
}

void panel(const float* x, int64_t m_size, int64_t k_size, const uint16_t* panel, int64_t n0, int64_t n_size,
           float* out) {
  int64_t m = 0;
  for (; m + kRows <= m_size; m += kRows) panel_rows<kRows>(x + m * k_size, k_size, panel, n0, n_size, out + m * n_size);
  const float* xm = x + m * k_size;
  float* om = out + m * n_size;
  switch (m_size - m) {
    case 3: panel_rows<3>(xm, k_size, panel, n0, n_size, om); break;
    case 2: panel_rows<2>(xm, k_size, panel, n0, n_size, om); break;
    case 1: panel_rows<1>(xm, k_size, panel, n0, n_size, om); break;
    default: break;
  }
}

}  // namespace

// weight [N, K] (any float dtype) -> [ceil(N / 16), K, 16] bfloat16, the layout bf16_weight_linear reads.
torch::Tensor pack_bf16_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "weight: [N, K]");
  const int64_t n_size = weight.size(0), k_size = weight.size(1), panels = (n_size + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, k_size}, weight.options().dtype(torch::kBFloat16));
  padded.narrow(0, 0, n_size).copy_(weight);
  return padded.view({panels, kPanel, k_size}).transpose(1, 2).contiguous();
}

// x [M, K] float32, packed from pack_bf16_weight of an [n_size, K] weight -> [M, n_size] float32.
torch::Tensor bf16_weight_linear(torch::Tensor x, torch::Tensor packed, int64_t n_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(2) == kPanel && packed.size(0) * kPanel >= n_size,
              "packed: [ceil(N / 16), K, 16] bfloat16 from pack_bf16_weight");
  auto xc = x.contiguous();
  const int64_t m_size = xc.size(0), k_size = xc.size(1);
  auto out = torch::empty({m_size, n_size}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  float* op = out.data_ptr<float>();
  const int64_t panels = (n_size + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel(xp, m_size, k_size, wp + p * k_size * kPanel, p * kPanel, n_size, op);
  });
  return out;
}
