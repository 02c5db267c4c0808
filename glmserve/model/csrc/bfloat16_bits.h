// bfloat16 <-> float32 on the raw bits, as c10::BFloat16 converts (round to nearest even, a NaN stays a
// NaN), written so that the compiler vectorises the loops that use them (c10's scalar conversions
// kept those loops scalar: 3-5x slower).

#pragma once

#include <cstdint>
#include <cstring>

namespace glmserve {

inline float widen(uint16_t bits) {
  const uint32_t word = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

inline uint16_t narrow(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof word);
  const uint32_t rounded = (word + 0x7FFFu + ((word >> 16) & 1u)) >> 16;
  const bool nan = (word & 0x7FFFFFFFu) > 0x7F800000u;  // not std::isnan: a compare the compiler vectorises
  return nan ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// One elementwise op of torch on bfloat16 values: computed in float32, rounded once.
inline uint16_t mul(uint16_t a, uint16_t b) { return narrow(widen(a) * widen(b)); }
inline uint16_t add(uint16_t a, uint16_t b) { return narrow(widen(a) + widen(b)); }
inline uint16_t sub(uint16_t a, uint16_t b) { return narrow(widen(a) - widen(b)); }

}  // namespace glmserve
