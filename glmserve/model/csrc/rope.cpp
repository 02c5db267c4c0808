// Rotary position embedding, GLM/DeepSeek interleaved flavour, as glmserve.model.rope.apply_rope computes
// it with ten torch ops: pairs (x0, x1), (x2, x3), ... rotate by their position's angles and the result
// is stored de-interleaved (evens, then odds). Each product, difference and sum is rounded to the
// element type as torch's elementwise ops round it (bfloat16: computed in float32, rounded to nearest
// even; float32 is built without contracting a * b - c * d into a fused multiply-add), so the result is
// the same bits.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>

#include "bfloat16_bits.h"

namespace {

// One element type's arithmetic, as torch's elementwise ops round it.
struct Float32 {
  using T = float;
  static float mul(float a, float b) { return a * b; }
  static float add(float a, float b) { return a + b; }
  static float sub(float a, float b) { return a - b; }
};

struct BFloat16Bits {
  using T = uint16_t;  // c10::BFloat16's bits
  static uint16_t mul(uint16_t a, uint16_t b) { return glmserve::mul(a, b); }
  static uint16_t add(uint16_t a, uint16_t b) { return glmserve::add(a, b); }
  static uint16_t sub(uint16_t a, uint16_t b) { return glmserve::sub(a, b); }
};

template <typename Op>
void rotate(const typename Op::T* in, int64_t row_stride, int64_t head_stride, const typename Op::T* cosines,
            const typename Op::T* sines, typename Op::T* result, int64_t rows, int64_t heads, int64_t half) {
  using T = typename Op::T;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cosines + r * half;
      const T* s = sines + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* pairs = in + r * row_stride + h * head_stride;
        T* o = result + (r * heads + h) * 2 * half;
        for (int64_t i = 0; i < half; ++i) {
          const T even = pairs[2 * i], odd = pairs[2 * i + 1];
          o[i] = Op::sub(Op::mul(even, c[i]), Op::mul(odd, s[i]));
          o[half + i] = Op::add(Op::mul(odd, c[i]), Op::mul(even, s[i]));
        }
      }
    }
  });
}

template <typename Op, typename Scalar>
void rotate_tensors(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  using T = typename Op::T;
  rotate<Op>(reinterpret_cast<const T*>(x.data_ptr<Scalar>()), x.stride(0), x.stride(1),
             reinterpret_cast<const T*>(cos.data_ptr<Scalar>()), reinterpret_cast<const T*>(sin.data_ptr<Scalar>()),
             reinterpret_cast<T*>(out.data_ptr<Scalar>()), x.size(0), x.size(1), cos.size(1));
}

}  // namespace

// x [R, H, D] (the last dimension contiguous), cos and sin [R, D / 2] -> [R, H, D] contiguous.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes(), "x [R, H, D], cos and sin [R, D/2]");
  TORCH_CHECK(x.size(0) == cos.size(0) && x.size(2) == 2 * cos.size(1), "cos and sin: [R, D/2] of x [R, H, D]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "one dtype");
  auto input = x.stride(2) == 1 ? x : x.contiguous();
  auto c = cos.contiguous(), s = sin.contiguous();
  auto out = torch::empty(x.sizes(), x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    rotate_tensors<BFloat16Bits, c10::BFloat16>(input, c, s, out);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x: bfloat16 or float32");
    rotate_tensors<Float32, float>(input, c, s, out);
  }
  return out;
}
