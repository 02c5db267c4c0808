// Absorbed attention over the selected rows of the paged latent cache, read in place: what
// glmserve.model.attention.attend_rows computes over the rows PagedKVCache.rows_at copies out, without the
// copy, the two batched products, the mask and the softmax as separate passes over memory.
//
// For each query (b, s) and head h, over its K selected rows r_k (row index[b, s, k] of the cache's row
// windows, PagedKVCache.row_index):
//   score_k = query[b, s, h, :] . r_k                      (masked to the lowest float where not allowed)
//   p = softmax(score) in float32
//   out[b, s, h, :] = sum_k p_k * r_k[:latent]
// In bfloat16 the score and p are rounded to bfloat16 where the torch ops round them (their products'
// outputs and the softmax's conversion), and the output once. Sums run in float32, in an order of their own,
// so a value can differ from the torch ops' in its last bits. Each query's output depends on nothing else
// in the batch: decode and verification steps agree.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "bfloat16_bits.h"
#include "float_vectors.h"

namespace {

using glmserve::broadcast;
using glmserve::fma;
using glmserve::Floats;
using glmserve::load;
constexpr int64_t kWidth = glmserve::kFloats;

// The rounding of a value the torch ops would hold in the cache's dtype.
inline float as_stored(float x, float) { return x; }
inline float as_stored(float x, c10::BFloat16) { return glmserve::widen(glmserve::narrow(x)); }

inline void store(float x, float* out) { *out = x; }
inline void store(float x, c10::BFloat16* out) { out->x = glmserve::narrow(x); }

inline float sum(Floats v) {
  typedef float Half __attribute__((vector_size(16)));
  Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  h += __builtin_shufflevector(h, h, 2, 3, 0, 1);
  h += __builtin_shufflevector(h, h, 1, 0, 3, 2);
  return h[0];
}

// Rows are scattered over the cache and cold (a decode step reads every layer of every sequence): each
// row's cache lines are asked for a few rows before they are read.
constexpr int64_t kAhead = 4;

template <typename Cache>
inline void prefetch_row(const Cache* row, int64_t width) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < int64_t(width * sizeof(Cache)); i += 64) __builtin_prefetch(bytes + i);
}

struct Shapes {
  int64_t queries, heads, width, latent, selected, step, windows;
};

// Row k as float32: float32 rows are read in place, bfloat16 ones widened into buffer row k.
inline const float* widened(const float* row, int64_t, float*, int64_t) { return row; }
inline const float* widened(const c10::BFloat16* row, int64_t width, float* buffer, int64_t k) {
  float* out = buffer + k * width;
  for (int64_t c = 0; c < width; ++c) out[c] = glmserve::widen(row[c].x);
  return out;
}

// scores[h * K + k] = q[h] . row for the heads [h0, h0 + kHeads): the row is read once for all of them,
// and their sums are independent chains.
constexpr int64_t kHeads = 4;

void score_heads(const float* q, const float* row, const Shapes& s, int64_t h0, int64_t k, float* scores) {
  const int64_t whole = s.width / (2 * kWidth) * (2 * kWidth);
  const float *q0 = q + h0 * s.width, *q1 = q0 + s.width, *q2 = q1 + s.width, *q3 = q2 + s.width;
  // Two chains a head (the adds' latency, not their count, bounds this loop), named: an array of them
  // was zeroed through memory on every call.
  Floats a0 = {}, b0 = {}, a1 = {}, b1 = {}, a2 = {}, b2 = {}, a3 = {}, b3 = {};
  for (int64_t c = 0; c < whole; c += 2 * kWidth) {
    const Floats r = load(row + c), t = load(row + c + kWidth);
    a0 = fma(load(q0 + c), r, a0), b0 = fma(load(q0 + c + kWidth), t, b0);
    a1 = fma(load(q1 + c), r, a1), b1 = fma(load(q1 + c + kWidth), t, b1);
    a2 = fma(load(q2 + c), r, a2), b2 = fma(load(q2 + c + kWidth), t, b2);
    a3 = fma(load(q3 + c), r, a3), b3 = fma(load(q3 + c + kWidth), t, b3);
  }
  const float totals[kHeads] = {sum(a0 + b0), sum(a1 + b1), sum(a2 + b2), sum(a3 + b3)};
  for (int64_t j = 0; j < kHeads; ++j) {
    float total = totals[j];
    for (int64_t c = whole; c < s.width; ++c) total += q[(h0 + j) * s.width + c] * row[c];
    scores[(h0 + j) * s.selected + k] = total;
  }
}

void score_head(const float* q, const float* row, const Shapes& s, int64_t h, int64_t k, float* scores) {
  float total = 0.0f;
  for (int64_t c = 0; c < s.width; ++c) total += q[h * s.width + c] * row[c];
  scores[h * s.selected + k] = total;
}

typedef int32_t Ints __attribute__((vector_size(32)));

// exp(x) of eight floats: x = n ln2 + r, |r| <= ln2 / 2, Cephes' polynomial for exp(r) (about 1 ulp, as the
// vectorised exp torch's softmax runs), 2^n from the exponent bits; 0 below -87.3 (where expf is 0 or
// subnormal), as for the masked scores.
inline Floats exp8(Floats x) {
  const Floats floor_x = broadcast(-87.3f);
  const Ints under = x < floor_x;
  x = under ? floor_x : x;
  const Floats shift = broadcast(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const Floats n = (x * 1.44269504f + shift) - shift;
  const Floats r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Floats p = broadcast(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  Floats scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return (Floats)((Ints)(p * scale) & ~under);
}

// Softmax of each head's K scores in place, in float32; masked scores count as the lowest float, as
// masked_fill does before the torch softmax (a query with none allowed attends all alike).
template <typename Cache>
void softmax(float* scores, const bool* allowed, const Shapes& s) {
  const int64_t whole = s.selected / kWidth * kWidth;
  for (int64_t h = 0; h < s.heads; ++h) {
    float* p = scores + h * s.selected;
    if (allowed != nullptr) {
      for (int64_t k = 0; k < s.selected; ++k) {
        if (!allowed[k]) p[k] = std::numeric_limits<float>::lowest();
      }
    }
    const float top = *std::max_element(p, p + s.selected);
    Floats totals = {};
    for (int64_t k = 0; k < whole; k += kWidth) {
      const Floats e = exp8(load(p + k) - top);
      std::memcpy(p + k, &e, sizeof e);
      totals += e;
    }
    float total = sum(totals);
    for (int64_t k = whole; k < s.selected; ++k) total += (p[k] = std::exp(p[k] - top));
    for (int64_t k = 0; k < s.selected; ++k) p[k] = as_stored(p[k] / total, Cache{});
  }
}

// out[h, c] = sum_k p[h, k] * rows[k][c] for c < latent, heads [h0, h0 + kHeads) and 16 columns at a time
// in registers (each row is read once per 16 columns, from L1 or L2).
void weigh_heads(const float* p, const float* const* rows, const Shapes& s, int64_t h0, float* out) {
  const int64_t whole = s.latent / (2 * kWidth) * (2 * kWidth);
  for (int64_t c = 0; c < whole; c += 2 * kWidth) {
    const float *p0 = p + h0 * s.selected, *p1 = p0 + s.selected, *p2 = p1 + s.selected, *p3 = p2 + s.selected;
    Floats a0 = {}, b0 = {}, a1 = {}, b1 = {}, a2 = {}, b2 = {}, a3 = {}, b3 = {};
    for (int64_t k = 0; k < s.selected; ++k) {
      const Floats r = load(rows[k] + c), t = load(rows[k] + c + kWidth);
      const Floats w0 = broadcast(p0[k]), w1 = broadcast(p1[k]), w2 = broadcast(p2[k]), w3 = broadcast(p3[k]);
      a0 = fma(w0, r, a0), b0 = fma(w0, t, b0), a1 = fma(w1, r, a1), b1 = fma(w1, t, b1);
      a2 = fma(w2, r, a2), b2 = fma(w2, t, b2), a3 = fma(w3, r, a3), b3 = fma(w3, t, b3);
    }
    const Floats sums[kHeads][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}};
    for (int64_t j = 0; j < kHeads; ++j) std::memcpy(out + (h0 + j) * s.latent + c, sums[j], sizeof sums[j]);
  }
  for (int64_t j = 0; j < kHeads; ++j) {
    for (int64_t c = whole; c < s.latent; ++c) {
      float total = 0.0f;
      for (int64_t k = 0; k < s.selected; ++k) total += p[(h0 + j) * s.selected + k] * rows[k][c];
      out[(h0 + j) * s.latent + c] = total;
    }
  }
}

void weigh_head(const float* p, const float* const* rows, const Shapes& s, int64_t h, float* out) {
  for (int64_t c = 0; c < s.latent; ++c) {
    float total = 0.0f;
    for (int64_t k = 0; k < s.selected; ++k) total += p[h * s.selected + k] * rows[k][c];
    out[h * s.latent + c] = total;
  }
}

// What one query's attention needs besides its inputs, allocated once per thread.
struct Scratch {
  std::vector<float> scores, acc, widened;
  std::vector<const float*> rows;
  Scratch(const Shapes& s, bool widens)  // float32 rows are read in place: nothing to widen them into
      : scores(s.heads * s.selected), acc(s.heads * s.latent), widened(widens ? s.selected * s.width : 0),
        rows(s.selected) {}
};

template <typename Cache>
void attend_query(const float* q, const Cache* base, const int64_t* index, const bool* allowed, const Shapes& s,
                  Scratch& w, Cache* out) {
  const int64_t grouped = s.heads / kHeads * kHeads;
  for (int64_t k = 0; k < s.selected; ++k) {
    if (k + kAhead < s.selected) prefetch_row(base + index[k + kAhead] * s.step, s.width);
    const float* row = w.rows[k] = widened(base + index[k] * s.step, s.width, w.widened.data(), k);
    for (int64_t h = 0; h < grouped; h += kHeads) score_heads(q, row, s, h, k, w.scores.data());
    for (int64_t h = grouped; h < s.heads; ++h) score_head(q, row, s, h, k, w.scores.data());
  }
  for (float& score : w.scores) score = as_stored(score, Cache{});
  softmax<Cache>(w.scores.data(), allowed, s);
  for (int64_t h = 0; h < grouped; h += kHeads) weigh_heads(w.scores.data(), w.rows.data(), s, h, w.acc.data());
  for (int64_t h = grouped; h < s.heads; ++h) weigh_head(w.scores.data(), w.rows.data(), s, h, w.acc.data());
  for (int64_t i = 0; i < s.heads * s.latent; ++i) store(w.acc[i], out + i);
}

template <typename Cache>
void attend_all(const Shapes& s, const float* query, const Cache* base, const int64_t* index, const bool* allowed,
                Cache* out) {
  at::parallel_for(0, s.queries, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(s, !std::is_same_v<Cache, float>);
    for (int64_t i = begin; i < end; ++i) {
      attend_query(query + i * s.heads * s.width, base, index + i * s.selected,
                   allowed == nullptr ? nullptr : allowed + i * s.selected, s, scratch, out + i * s.heads * s.latent);
    }
  });
}

}  // namespace

// query [B, S, H, C] (scaled, float32; C = latent + rope), view [num_blocks, block_size, C] (a layer's
// latent rows, bfloat16 or float32, C contiguous), index [B, S, K] int64 (PagedKVCache.row_index), allowed
// [B, S, K] bool or None (None: all) -> [B, S, H, latent_dim] in the view's dtype.
torch::Tensor paged_latent_attention(torch::Tensor query, torch::Tensor view, torch::Tensor index,
                                     std::optional<torch::Tensor> allowed, int64_t latent_dim) {
  TORCH_CHECK(query.dim() == 4 && view.dim() == 3 && index.dim() == 3,
              "query [B, S, H, C], view [N, block_size, C], index [B, S, K]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "query: float32");
  TORCH_CHECK(view.stride(2) == 1 && view.size(2) == query.size(3), "view: [N, block_size, C], C contiguous");
  TORCH_CHECK(index.size(0) == query.size(0) && index.size(1) == query.size(1), "index: [B, S, K]");
  TORCH_CHECK(0 < latent_dim && latent_dim <= view.size(2), "latent_dim: within the row");
  const int64_t step = std::gcd(view.stride(0), view.stride(1));
  const int64_t total = int64_t(view.storage().nbytes()) / view.element_size() - view.storage_offset();
  const Shapes s{index.size(0) * index.size(1), query.size(2), view.size(2), latent_dim, index.size(2), step,
                 (total - view.size(2)) / step + 1};
  auto ic = index.to(torch::kInt64).contiguous();
  const int64_t* rows = ic.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(rows, rows + ic.numel(), [&](int64_t r) { return 0 <= r && r < s.windows; }),
              "index: a row outside the cache");  // index_select's bounds check
  torch::Tensor ac;
  if (allowed.has_value()) {
    ac = allowed->to(torch::kBool).contiguous();
    TORCH_CHECK(ac.numel() == ic.numel(), "allowed: one flag per selected row");
  }
  const bool* allowed_ptr = allowed.has_value() ? ac.data_ptr<bool>() : nullptr;
  auto qc = query.contiguous();
  auto out = torch::empty({query.size(0), query.size(1), s.heads, latent_dim}, view.options());
  if (view.scalar_type() == torch::kBFloat16) {
    attend_all(s, qc.data_ptr<float>(), view.data_ptr<c10::BFloat16>(), rows, allowed_ptr,
               out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(view.scalar_type() == torch::kFloat32, "view: bfloat16 or float32");
    attend_all(s, qc.data_ptr<float>(), view.data_ptr<float>(), rows, allowed_ptr, out.data_ptr<float>());
  }
  return out;
}
