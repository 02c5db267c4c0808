// Eight float32 values in one register (GCC/Clang vector extensions; AVX2 on x86-64), and the few
// operations the kernels build their loops from: the compiler's own vectoriser made a scalar mess of them.

#pragma once

#include <cstdint>
#include <cstring>

#ifdef __FMA__
#include <immintrin.h>
#endif

namespace glmserve {

typedef float Floats __attribute__((vector_size(32)));
constexpr int64_t kFloats = 8;

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Floats broadcast(float x) { return Floats{x, x, x, x, x, x, x, x}; }  // not {} + x: a scalar add first

// a * b + c rounded once where the CPU can (the matmuls the kernels' products replace do the same).
inline Floats fma(Floats a, Floats b, Floats c) {
#ifdef __FMA__
  return (Floats)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

}  // namespace glmserve
