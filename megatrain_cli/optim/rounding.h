// Stochastic rounding's random bits and the rounding to bf16 they drive, shared by the host AdamW kernels
// (adamw_cpp.cpp: bf16 masters; adamw_state.cpp: bf16 / int8 moments and bf16 masters). The bits of element
// i are mix32(key ^ i), key = store/moments.sr_key(seed, tile, step, which): store/moments.py's mix32 and
// stochastic_bf16, which the torch paths run, bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace megatrain {

inline uint32_t mix32(uint32_t x) {  // store/moments.mix32
  x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}

// fp32 -> bf16 bits, rounded stochastically (store/moments.stochastic_bf16): the magnitude's low 16 bits plus 16
// random bits carry into the kept ones; the sign bit is above any carry.
inline uint16_t bf16_sr(float f, uint32_t key, uint32_t index) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + (mix32(key ^ index) & 0xFFFFu)) >> 16);
}

__attribute__((target("avx2,fma"))) inline __m256i mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// bf16_sr of 8 lanes, elements first .. first + 7: the bf16 bits in the low 16 of each 32-bit lane.
__attribute__((target("avx2,fma"))) inline __m256i bf16_sr8(__m256 x, uint32_t key, uint32_t first) {
  const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(int(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i noise = _mm256_and_si256(mix32x8(_mm256_xor_si256(_mm256_set1_epi32(int(key)), at)),
                                         _mm256_set1_epi32(0xFFFF));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), noise), 16);
}

}  // namespace megatrain
