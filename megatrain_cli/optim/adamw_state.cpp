// The host AdamW over bf16 or int8 moments (train.optimizer_state): one pass over a tile, block by block.
// Each 64-element block's moments are decoded into local fp32 buffers, updated with the formula of
// state_adamw.py (the same fp32 operations in the same order: no FMA, -ffp-contract=off), the weight
// stored (a bf16 master rounded to nearest even, or stochastically: train.master_rounding), and the moments coded back, rounded stochastically from a counter hash (int8: e4m3 codes with a
// power-of-two scale per block). What the formats are and why: store/moments.py.
// Vector code: AVX2 over whole blocks (e4m3 decoded and coded by integer ops, the random bits by vector
// multiplies), decoding in registers, chosen at run time as adamw_cpp.cpp does; scalar C++ elsewhere and
// for a tile's short last block. The same IEEE operations without contraction give the same bits in both.
// Part of the extension adamw_cpp.py loads (its bindings are in adamw_cpp.cpp).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "rounding.h"

namespace {

using megatrain::mix32;
using megatrain::mix32x8;

constexpr int64_t kBlock = 64;        // store/moments.BLOCK
constexpr int64_t kGrainBlocks = 1024;  // at least 64K elements per thread

struct StateConsts {
  float w1, beta2, c2, bc2s, eps, neg_step, decay, inv_clip;
  bool scaled;
};

inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// e4m3fn bits of |y| <= 448, rounded stochastically by 20 random bits r (store/moments.stochastic_e4m3): above
// e4m3's subnormals the dropped mantissa bits plus r carry into the kept 3; below, floor(|y| 2^9 + r 2^-20).
inline uint8_t to_e4m3_sr(float y, uint32_t r) {
  uint32_t u = bits_of(y);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  r &= 0xFFFFFu;
  const uint32_t sub = uint32_t(int32_t(float_of(u) * 512.0f + float(r) * (1.0f / 1048576.0f)));
  const uint32_t norm = ((u + r) >> 20) - (120u << 3);
  return uint8_t((u < (121u << 23) ? sub : norm) | (sign >> 24));
}

struct Table {  // e4m3fn code -> fp32 (c10's conversion, as torch's .float())
  float v[256];
  Table() { for (int i = 0; i < 256; ++i) v[i] = float(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits())); }
};
const Table& table() { static const Table t; return t; }

// The least e with absmax <= 448 * 2^e, clamped to [-126, 126] (store/moments.block_exponents).
inline int block_exponent(float absmax) {
  int ex;
  const float mant = std::frexp(absmax, &ex);
  int e = ex - 9 + (mant > 0.875f ? 1 : 0);
  return e < -126 ? -126 : (e > 126 ? 126 : e);
}

inline float bf16_float(uint16_t b) { return float_of(uint32_t(b) << 16); }
inline uint16_t bf16_rne(float f) {  // as adamw_cpp.cpp's float_to_bf16 (torch's cast)
  if (std::isnan(f)) return 0xFFFF;
  const uint32_t u = bits_of(f);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float load1(const float* p, int64_t i) { return p[i]; }
inline float load1(const uint16_t* p, int64_t i) { return bf16_float(p[i]); }

// What one block's update needs besides its pointers.
struct BlockArgs {
  void* m; void* v; int8_t* me; int8_t* ve;  // moments (bf16 bits or e4m3 codes), int8's block exponents
  bool int8;
  int64_t decay_numel;
  uint32_t origin, key_m, key_v;
  bool sr_master;  // bf16 masters rounded stochastically (train.master_rounding), with key_p
  uint32_t key_p;
};

// A new weight stored: an fp32 master as it is; a bf16 one rounded to nearest even, or stochastically from the
// bits of element origin + i (rounding.h).
inline void store_master(float* p, int64_t i, float x, const BlockArgs&) { p[i] = x; }
inline void store_master(uint16_t* p, int64_t i, float x, const BlockArgs& a) {
  p[i] = a.sr_master ? megatrain::bf16_sr(x, a.key_p, a.origin + uint32_t(i)) : bf16_rne(x);
}

// ---------------------------------------------------------------- scalar (any CPU; a tile's short last block)
inline void code_scalar(uint8_t* out, int8_t* exp, const float* x, int64_t n, float absmax, uint32_t key,
                        uint32_t first) {
  const int e = block_exponent(absmax);
  *exp = int8_t(e);
  const float inv = std::ldexp(1.0f, -e);  // exact scaling: a power of two
  for (int64_t i = 0; i < n; ++i) out[i] = to_e4m3_sr(x[i] * inv, mix32(key ^ (first + uint32_t(i))));
}

template <typename P, typename G>
void block_scalar(P* p, const G* gp, int64_t lo, int64_t n, const BlockArgs& a, const StateConsts& k) {
  float mb[kBlock], vb[kBlock], sb[kBlock];
  const int64_t b = lo / kBlock;
  const float* t = table().v;
  for (int64_t i = 0; i < n; ++i) {
    if (a.int8) {
      mb[i] = t[static_cast<const uint8_t*>(a.m)[lo + i]] * std::ldexp(1.0f, a.me[b]);
      const float r = t[static_cast<const uint8_t*>(a.v)[lo + i]] * std::ldexp(1.0f, a.ve[b]);
      vb[i] = r * r;
    } else {
      mb[i] = bf16_float(static_cast<const uint16_t*>(a.m)[lo + i]);
      vb[i] = bf16_float(static_cast<const uint16_t*>(a.v)[lo + i]);
    }
  }
  float amax_m = 0.0f, amax_s = 0.0f;
  for (int64_t i = 0; i < n; ++i) {  // state_adamw.adam_math, op for op
    float g = load1(gp, lo + i);
    if (k.scaled) g = g / k.inv_clip;
    const float mv = mb[i] + (g - mb[i]) * k.w1;
    const float vv = vb[i] * k.beta2 + (g * g) * k.c2;
    const float s = std::sqrt(vv);
    float pv = load1(p, lo + i);
    if (lo + i < a.decay_numel) pv = pv * k.decay;
    store_master(p, lo + i, pv + (mv * k.neg_step) / (s / k.bc2s + k.eps), a);
    mb[i] = mv; vb[i] = vv; sb[i] = s;
    amax_m = std::max(amax_m, std::fabs(mv));
    amax_s = std::max(amax_s, s);
  }
  if (a.int8) {
    const uint32_t at = a.origin + uint32_t(lo);
    code_scalar(static_cast<uint8_t*>(a.m) + lo, a.me + b, mb, n, amax_m, a.key_m, at);
    code_scalar(static_cast<uint8_t*>(a.v) + lo, a.ve + b, sb, n, amax_s, a.key_v, at);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {  // stochastic rounding: the magnitude carries, the sign bit is untouched
    const uint32_t at = a.origin + uint32_t(lo + i);
    static_cast<uint16_t*>(a.m)[lo + i] = megatrain::bf16_sr(mb[i], a.key_m, at);
    static_cast<uint16_t*>(a.v)[lo + i] = megatrain::bf16_sr(vb[i], a.key_v, at);
  }
}

// ---------------------------------------------------------------- AVX2 (whole blocks): the same operations
#define MT_AVX2 __attribute__((target("avx2,fma")))
MT_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
MT_AVX2 inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
MT_AVX2 inline void store_u16x8(uint16_t* out, __m256i r) {  // 8 values < 2^16
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128((__m128i*)out, _mm256_castsi256_si128(packed));
}
MT_AVX2 inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
MT_AVX2 inline void store8(uint16_t* p, __m256 x) {  // bf16_rne
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  store_u16x8(p, r);
}
MT_AVX2 inline void store_master8(float* p, int64_t i, __m256 x, const BlockArgs&) { _mm256_storeu_ps(p + i, x); }
MT_AVX2 inline void store_master8(uint16_t* p, int64_t i, __m256 x, const BlockArgs& a) {  // store_master, 8 lanes
  if (a.sr_master) store_u16x8(p + i, megatrain::bf16_sr8(x, a.key_p, a.origin + uint32_t(i)));
  else store8(p + i, x);
}
MT_AVX2 inline void store_e4m3x8(uint8_t* out, __m256 y, __m256i r) {  // to_e4m3_sr, lane by lane
  __m256i u = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(int(0x80000000u)));
  u = _mm256_xor_si256(u, sign);
  r = _mm256_and_si256(r, _mm256_set1_epi32(0xFFFFF));
  const __m256i sub = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(u), _mm256_set1_ps(512.0f)),
                                                        _mm256_mul_ps(_mm256_cvtepi32_ps(r), _mm256_set1_ps(1.0f / 1048576.0f))));
  const __m256i norm = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(u, r), 20), _mm256_set1_epi32(120 << 3));
  __m256i c = _mm256_blendv_epi8(norm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), u));
  c = _mm256_or_si256(c, _mm256_srli_epi32(sign, 24));
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i t = _mm256_shuffle_epi8(c, pick);
  _mm_storel_epi64((__m128i*)out, _mm_unpacklo_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}
MT_AVX2 inline float hmax8(__m256 x) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
MT_AVX2 inline void code_avx2(uint8_t* out, int8_t* exp, const float* x, float absmax, uint32_t key, uint32_t first) {
  const int e = block_exponent(absmax);
  *exp = int8_t(e);
  const __m256 inv = _mm256_set1_ps(std::ldexp(1.0f, -e));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), k = _mm256_set1_epi32(int(key));
  for (int64_t i = 0; i < kBlock; i += 8) {
    const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(int(first + uint32_t(i))), lane);
    store_e4m3x8(out + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv), mix32x8(_mm256_xor_si256(k, at)));
  }
}

MT_AVX2 inline __m256 decode_e4m3x8(const uint8_t* q) {  // arithmetically: the table's values, no gather
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256 norm = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(7))),
                                   _mm256_set1_ps(1.0f / 512));  // exponent field 0: m * 2^-9
  const __m256 x = _mm256_blendv_ps(norm, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  return _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
}

template <typename P, typename G>
MT_AVX2 void block_avx2(P* p, const G* gp, int64_t lo, const BlockArgs& a, const StateConsts& k) {
  alignas(32) float mb[kBlock], sb[kBlock];  // int8: the new m and sqrt(v), until the block's scale is known
  const int64_t b = lo / kBlock;
  const __m256 sm = _mm256_set1_ps(a.int8 ? std::ldexp(1.0f, a.me[b]) : 1.0f);
  const __m256 sv = _mm256_set1_ps(a.int8 ? std::ldexp(1.0f, a.ve[b]) : 1.0f);
  const __m256 w1 = _mm256_set1_ps(k.w1), b2 = _mm256_set1_ps(k.beta2), c2 = _mm256_set1_ps(k.c2);
  const __m256 bc2s = _mm256_set1_ps(k.bc2s), eps = _mm256_set1_ps(k.eps), neg = _mm256_set1_ps(k.neg_step);
  const __m256 decay = _mm256_set1_ps(k.decay), inv_clip = _mm256_set1_ps(k.inv_clip);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t decayed = std::min<int64_t>(kBlock, std::max<int64_t>(0, a.decay_numel - lo));
  __m256 amax_m = _mm256_setzero_ps(), amax_s = _mm256_setzero_ps();
  for (int64_t i = 0; i < kBlock; i += 8) {
    __m256 g = load8(gp + lo + i);
    if (k.scaled) g = _mm256_div_ps(g, inv_clip);
    __m256 m0, v0;
    if (a.int8) {
      m0 = _mm256_mul_ps(decode_e4m3x8(static_cast<const uint8_t*>(a.m) + lo + i), sm);
      const __m256 r = _mm256_mul_ps(decode_e4m3x8(static_cast<const uint8_t*>(a.v) + lo + i), sv);
      v0 = _mm256_mul_ps(r, r);
    } else {
      m0 = load8(static_cast<const uint16_t*>(a.m) + lo + i);
      v0 = load8(static_cast<const uint16_t*>(a.v) + lo + i);
    }
    const __m256 mv = _mm256_add_ps(m0, _mm256_mul_ps(_mm256_sub_ps(g, m0), w1));
    const __m256 vv = _mm256_add_ps(_mm256_mul_ps(v0, b2), _mm256_mul_ps(_mm256_mul_ps(g, g), c2));
    const __m256 s = _mm256_sqrt_ps(vv);
    __m256 pv = load8(p + lo + i);
    const __m256i in_decay = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(decayed - i)), lane);
    pv = _mm256_blendv_ps(pv, _mm256_mul_ps(pv, decay), _mm256_castsi256_ps(in_decay));
    pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(mv, neg), _mm256_add_ps(_mm256_div_ps(s, bc2s), eps)));
    store_master8(p, lo + i, pv, a);
    if (a.int8) {
      _mm256_store_ps(mb + i, mv);
      _mm256_store_ps(sb + i, s);
      amax_m = _mm256_max_ps(amax_m, _mm256_and_ps(mv, abs_mask));
      amax_s = _mm256_max_ps(amax_s, s);
    } else {  // stochastic rounding straight away
      const uint32_t at = a.origin + uint32_t(lo + i);
      store_u16x8(static_cast<uint16_t*>(a.m) + lo + i, megatrain::bf16_sr8(mv, a.key_m, at));
      store_u16x8(static_cast<uint16_t*>(a.v) + lo + i, megatrain::bf16_sr8(vv, a.key_v, at));
    }
  }
  if (a.int8) {
    const uint32_t at = a.origin + uint32_t(lo);
    code_avx2(static_cast<uint8_t*>(a.m) + lo, a.me + b, mb, hmax8(amax_m), a.key_m, at);
    code_avx2(static_cast<uint8_t*>(a.v) + lo, a.ve + b, sb, hmax8(amax_s), a.key_v, at);
  }
}

bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

template <typename P, typename G>
void run_state(P* p, const G* gp, int64_t numel, const BlockArgs& a, const StateConsts& k) {
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  const bool avx2 = cpu_has_avx2();
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, n = std::min(kBlock, numel - lo);
      if (avx2 && n == kBlock) block_avx2(p, gp, lo, a, k);
      else block_scalar(p, gp, lo, n, a, k);
    }
  });
}

}  // namespace

void adamw_state_update(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                        at::Tensor exp_avg_exp, at::Tensor exp_avg_sq_exp, double step, double lr, double beta1,
                        double beta2, double eps, double weight_decay, double clip, int64_t decay_numel,
                        int64_t origin, int64_t key_m, int64_t key_v, int64_t key_p) {
  // key_p: the bf16 masters' stochastic rounding key (train.master_rounding=stochastic); < 0: nearest even
  TORCH_CHECK(clip > 0.0, "clip coefficient must be > 0");
  const int64_t numel = master.numel();
  const bool int8 = exp_avg.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(int8 || exp_avg.scalar_type() == at::kBFloat16, "moments must be bf16 or float8_e4m3fn");
  for (const at::Tensor* t : {&master, &grad, &exp_avg, &exp_avg_sq})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->numel() == numel,
                "sections must be contiguous CPU tensors of the same numel");
  TORCH_CHECK(exp_avg_sq.scalar_type() == exp_avg.scalar_type(), "both moments must have one format");
  TORCH_CHECK(master.scalar_type() == at::kFloat || master.scalar_type() == at::kBFloat16, "master: fp32 or bf16");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, "grad: fp32 or bf16");
  const int64_t blocks = int8 ? (numel + kBlock - 1) / kBlock : 0;
  for (const at::Tensor* t : {&exp_avg_exp, &exp_avg_sq_exp})
    TORCH_CHECK(t->scalar_type() == at::kChar && t->is_contiguous() && t->numel() == blocks,
                "block exponents: contiguous int8, one per 64-element block (int8 moments)");
  // The scalars as make_consts forms them: in double, rounded to fp32 where they enter the math.
  const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
  StateConsts k{float(1 - beta1), float(beta2), float(1 - beta2), float(std::sqrt(bc2)), float(eps),
                float(-(lr / bc1)), float(1 - lr * weight_decay), float(1.0 / clip), clip != 1.0};
  BlockArgs a{exp_avg.data_ptr(), exp_avg_sq.data_ptr(), int8 ? exp_avg_exp.data_ptr<int8_t>() : nullptr,
              int8 ? exp_avg_sq_exp.data_ptr<int8_t>() : nullptr, int8, decay_numel, uint32_t(origin),
              uint32_t(key_m), uint32_t(key_v), key_p >= 0, uint32_t(key_p)};
  const bool g16 = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  table();  // built once, before the threads read it
  pybind11::gil_scoped_release no_gil;
  auto over = [&](auto* p) {
    if (g16) run_state(p, static_cast<const uint16_t*>(g), numel, a, k);
    else run_state(p, static_cast<const float*>(g), numel, a, k);
  };
  if (master.scalar_type() == at::kBFloat16) over(reinterpret_cast<uint16_t*>(master.data_ptr()));
  else over(master.data_ptr<float>());
}
