// GLM's RMSNorm, one pass per row.
// - bfloat16 rows: normalised in float32, rounded to bfloat16, then scaled by the bfloat16 weight (each
//   product rounded), as glmserve.model.norms.rms_norm computes it with eight torch ops (a float32 copy of
//   the rows, its square, their mean, ...: passes over memory).
// - float32 rows: (x * rsqrt(mean(x^2) + eps)) * weight, each product rounded, as F.rms_norm computes it on
//   a CPU with six ops (~20 us a call at the bundled model's [8-32, 256]: 33 calls a decode step).
//
// The squares are summed in 16 float32 partial sums, torch's mean sums them in another order: where the
// two means differ in their last bit, a float32 output can differ in its last 1-3 bits, and a bfloat16
// normalised value can round one bfloat16 step apart, and its output after the weight by up to two (1
// element in ~700,000 of Gaussian rows of 128-256 values; 1 in 15,000 of 7,168 values).

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

inline float as_float(uint16_t bits) { return widen(bits); }
inline float as_float(float value) { return value; }

// 1 / sqrt(mean(row^2) + eps) in float32.
template <typename T>
float inverse_rms(const T* row, int64_t width, double eps) {
  float lanes[kLanes] = {};  // independent partial sums: no chain of dependent additions
  int64_t j = 0;
  for (; j + kLanes <= width; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = as_float(row[j + l]);
      lanes[l] += v * v;
    }
  }
  for (; j < width; ++j) {
    const float v = as_float(row[j]);
    lanes[0] += v * v;
  }
  double squares = 0.0;
  for (float lane : lanes) squares += lane;
  const float mean = static_cast<float>(squares / static_cast<double>(width));
  return 1.0f / std::sqrt(mean + static_cast<float>(eps));
}

void normalise(const uint16_t* row, const uint16_t* w, int64_t width, double eps, uint16_t* out) {
  const float inverse = inverse_rms(row, width, eps);
  for (int64_t i = 0; i < width; ++i) out[i] = narrow(widen(w[i]) * widen(narrow(widen(row[i]) * inverse)));
}

void normalise(const float* row, const float* w, int64_t width, double eps, float* out) {
  const float inverse = inverse_rms(row, width, eps);
  for (int64_t i = 0; i < width; ++i) out[i] = (row[i] * inverse) * w[i];
}

template <typename T>
void normalise_rows(const T* in, const T* w, int64_t rows, int64_t width, double eps, T* out) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalise(in + r * width, w, width, eps, out + r * width);
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x and weight: both bfloat16 or both float32");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight: [x.size(-1)]");
  auto input = x.contiguous();
  auto scale = weight.contiguous();
  auto result = torch::empty_like(input);
  const int64_t width = scale.size(0), rows = input.numel() / width;
  if (x.scalar_type() == torch::kFloat32) {
    normalise_rows(input.data_ptr<float>(), scale.data_ptr<float>(), rows, width, eps, result.data_ptr<float>());
  } else {  // c10::BFloat16 is one uint16_t of bits
    normalise_rows(reinterpret_cast<const uint16_t*>(input.data_ptr<c10::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(scale.data_ptr<c10::BFloat16>()), rows, width, eps,
                   reinterpret_cast<uint16_t*>(result.data_ptr<c10::BFloat16>()));
  }
  return result;
}
