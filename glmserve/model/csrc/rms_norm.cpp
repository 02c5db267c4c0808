// GLM's RMSNorm of bfloat16 rows, one pass per row: normalised in float32, rounded to bfloat16, then
// scaled by the bfloat16 weight (each product rounded), as glmserve.model.norms.rms_norm computes it
// with eight torch ops (a float32 copy of the rows, its square, their mean, ...: passes over memory).
//
// The squares are summed in 16 float32 partial sums, torch's mean sums them in another order: where the
// two means differ in their last bit, a normalised value can round one bfloat16 step apart, and its
// output after the weight by up to two (1 element in ~700,000 of Gaussian rows of 128-256 values; 1 in
// 15,000 of 7,168 values).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#include "bfloat16_bits.h"

using glmserve::narrow;
using glmserve::widen;

namespace {
constexpr int64_t kLanes = 16;
}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "x and weight: bfloat16");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight: [x.size(-1)]");
  auto input = x.contiguous();
  auto scale = weight.contiguous();
  auto result = torch::empty_like(input);
  const int64_t width = scale.size(0), rows = input.numel() / width;
  // c10::BFloat16 is one uint16_t of bits
  const uint16_t* in = reinterpret_cast<const uint16_t*>(input.data_ptr<c10::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(scale.data_ptr<c10::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(result.data_ptr<c10::BFloat16>());
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = in + r * width;
      float lanes[kLanes] = {};  // independent partial sums: no chain of dependent additions
      int64_t j = 0;
      for (; j + kLanes <= width; j += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = widen(row[j + l]);
          lanes[l] += v * v;
        }
      }
      for (; j < width; ++j) {
        const float v = widen(row[j]);
        lanes[0] += v * v;
      }
      double squares = 0.0;
      for (float lane : lanes) squares += lane;
      const float mean = static_cast<float>(squares / static_cast<double>(width));
      const float inverse = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      uint16_t* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        o[i] = narrow(widen(w[i]) * widen(narrow(widen(row[i]) * inverse)));
      }
    }
  });
  return result;
}
