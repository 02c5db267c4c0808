// The decode indexer's scores, read straight from the paged cache: what glmserve.model.indexer.Indexer.scores
// computes over the keys PagedKVCache.gather_blocks copies out, without the copy, the keys' float32
// conversion, the [S, H, T] products or the causal mask as separate passes.
//
// score[b, s, t] = sum_h weights[b, s, h] * relu(q[b, s, h, :] . key(b, t)) for t <= positions[b, s], -inf
// after, with key(b, t) the row t % block_size of block tables[b, t / block_size]. Keys are read tile by
// tile (kTile consecutive positions of one sequence, widened to float32 and transposed), and every query of
// the sequence scores that tile while it is in L1, eight positions to a register. The dot products add
// d = 0, 1, ... in turn and the heads h = 0, 1, ...: the same terms as the matmuls, summed in an order of
// their own, so a score can differ from the torch ops' in its last bits (and a NaN product counts as 0).
// Each query's scores depend on nothing else in the batch: decode and verification steps agree.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bfloat16_bits.h"
#include "float_vectors.h"

namespace {

constexpr int64_t kTile = 64;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return glmserve::widen(x.x); }

struct Shapes {
  int64_t batch, queries, heads, dim, block_size, width, num_blocks;
};

// Positions [t0, t0 + n) of sequence b, widened, into tile[d * kTile + i].
template <typename Key>
void load_tile(const Key* keys, int64_t block_stride, int64_t row_stride, const int64_t* table, int64_t block_size,
               int64_t t0, int64_t n, int64_t dim, float* tile) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    const Key* row = keys + table[t / block_size] * block_stride + (t % block_size) * row_stride;
    for (int64_t d = 0; d < dim; ++d) tile[d * kTile + i] = widen(row[d]);
  }
}

using glmserve::broadcast;
using glmserve::Floats;
using glmserve::load;
typedef int32_t Ints __attribute__((vector_size(32)));
constexpr int64_t kWidth = glmserve::kFloats;

inline Floats relu(Floats x) { return (Floats)((Ints)x & (x > Floats{})); }

// One query's scores over n positions of a loaded tile, into out[0, n): 16 positions at a time, their
// head sums in registers (a whole group is computed; columns past n are never stored).
void score_tile(const float* q, const float* weights, const float* tile, int64_t heads, int64_t dim, int64_t n,
                float* out) {
  for (int64_t i0 = 0; i0 < n; i0 += 2 * kWidth) {
    Floats total0 = {}, total1 = {};
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * dim;
      Floats head0 = {}, head1 = {};
      for (int64_t d = 0; d < dim; ++d) {
        const Floats qd = broadcast(qh[d]);
        const float* column = tile + d * kTile + i0;
        head0 += qd * load(column);
        head1 += qd * load(column + kWidth);
      }
      const Floats w = broadcast(weights[h]);
      total0 += w * relu(head0);
      total1 += w * relu(head1);
    }
    float group[2 * kWidth];
    std::memcpy(group, &total0, sizeof total0);
    std::memcpy(group + kWidth, &total1, sizeof total1);
    std::memcpy(out + i0, group, std::min(2 * kWidth, n - i0) * sizeof(float));
  }
}

template <typename Key>
void score_all(const Shapes& s, const float* q, const float* weights, const Key* keys, int64_t block_stride,
               int64_t row_stride, const int64_t* tables, const int64_t* positions, float* scores) {
  const int64_t t_all = s.width * s.block_size;
  at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(s.dim * kTile);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* pos = positions + b * s.queries;
      const int64_t visible = std::min(t_all, *std::max_element(pos, pos + s.queries) + 1);
      for (int64_t w = 0; w * s.block_size < visible; ++w) {  // index_select's bounds check, for the blocks read
        TORCH_CHECK(0 <= tables[b * s.width + w] && tables[b * s.width + w] < s.num_blocks,
                    "tables: block id out of range");
      }
      for (int64_t t0 = 0; t0 < visible; t0 += kTile) {
        const int64_t n = std::min(kTile, visible - t0);
        load_tile(keys, block_stride, row_stride, tables + b * s.width, s.block_size, t0, n, s.dim, tile.data());
        for (int64_t j = 0; j < s.queries; ++j) {
          const int64_t row = b * s.queries + j;
          const int64_t seen = std::min(n, pos[j] + 1 - t0);
          if (seen > 0) {
            score_tile(q + row * s.heads * s.dim, weights + row * s.heads, tile.data(), s.heads, s.dim, seen,
                       scores + row * t_all + t0);
          }
        }
      }
      for (int64_t j = 0; j < s.queries; ++j) {  // -inf after each query's position
        float* row = scores + (b * s.queries + j) * t_all;
        std::fill(row + std::max<int64_t>(0, std::min(t_all, pos[j] + 1)), row + t_all,
                  -std::numeric_limits<float>::infinity());
      }
    }
  });
}

}  // namespace

// q [B, S, H, D] and weights [B, S, H] float32, keys [num_blocks, block_size, D] (bfloat16 or float32, the
// last dimension contiguous), tables [B, W] and positions [B, S] int64 -> scores [B, S, W * block_size].
torch::Tensor paged_index_scores(torch::Tensor q, torch::Tensor weights, torch::Tensor keys, torch::Tensor tables,
                                 torch::Tensor positions) {
  TORCH_CHECK(q.dim() == 4 && weights.dim() == 3 && keys.dim() == 3 && tables.dim() == 2 && positions.dim() == 2,
              "q [B, S, H, D], weights [B, S, H], keys [N, block_size, D], tables [B, W], positions [B, S]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && weights.scalar_type() == torch::kFloat32, "q, weights: float32");
  TORCH_CHECK(keys.stride(2) == 1 && keys.size(2) == q.size(3), "keys: [N, block_size, D], D contiguous");
  const Shapes s{q.size(0), q.size(1), q.size(2), q.size(3), keys.size(1), tables.size(1), keys.size(0)};
  TORCH_CHECK(weights.size(0) == s.batch && weights.size(1) == s.queries && weights.size(2) == s.heads, "weights");
  TORCH_CHECK(tables.size(0) == s.batch && positions.size(0) == s.batch && positions.size(1) == s.queries,
              "tables [B, W], positions [B, S]");
  auto qc = q.contiguous(), wc = weights.contiguous();
  auto tc = tables.to(torch::kInt64).contiguous(), pc = positions.to(torch::kInt64).contiguous();
  auto scores = torch::empty({s.batch, s.queries, s.width * s.block_size}, q.options());
  if (keys.scalar_type() == torch::kBFloat16) {
    score_all(s, qc.data_ptr<float>(), wc.data_ptr<float>(), keys.data_ptr<c10::BFloat16>(), keys.stride(0),
              keys.stride(1), tc.data_ptr<int64_t>(), pc.data_ptr<int64_t>(), scores.data_ptr<float>());
  } else {
    TORCH_CHECK(keys.scalar_type() == torch::kFloat32, "keys: bfloat16 or float32");
    score_all(s, qc.data_ptr<float>(), wc.data_ptr<float>(), keys.data_ptr<float>(), keys.stride(0),
              keys.stride(1), tc.data_ptr<int64_t>(), pc.data_ptr<int64_t>(), scores.data_ptr<float>());
  }
  return scores;
}
