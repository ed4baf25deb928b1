// The host AdamW over bf16 or int8 moments (train.optimizer_state): one pass over a tile, block by block.
// Each 64-element block's moments are decoded into local fp32 buffers, updated with the formula of
// state_adamw.py (the same fp32 operations in the same order: no FMA, -ffp-contract=off), the weight
// stored, and the moments coded back (bf16: stochastic rounding from a counter hash; int8: e4m3 codes
// with a power-of-two scale per block). What the formats are and why: store/moments.py.
// Vector code: the loops are plain C++ over local buffers, compiled twice (target_clones: AVX2 and the
// baseline), the CPU picks at load time; IEEE operations without contraction give the same bits in both.
// Part of the extension adamw_cpp.py loads (its bindings are in adamw_cpp.cpp).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 64;        // store/moments.BLOCK
constexpr int64_t kGrainBlocks = 1024;  // at least 64K elements per thread

struct StateConsts {
  float w1, beta2, c2, bc2s, eps, neg_step, decay, inv_clip;
  bool scaled;
};

inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline uint32_t mix32(uint32_t x) {  // store/moments.mix32
  x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}

// fp32 -> e4m3fn bits, round to nearest even, for |x| <= 448 (c10's conversion without its saturation
// branch, which a coded block never reaches), branch-free so it vectorises.
inline uint8_t to_e4m3(float x) {
  uint32_t u = bits_of(x);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t denorm_mask = 141u << 23;  // 2^14 as fp32: adding it rounds a subnormal e4m3 into place
  const uint32_t sub = bits_of(float_of(u) + float_of(denorm_mask)) - denorm_mask;
  const uint32_t odd = (u >> 20) & 1u;
  const uint32_t norm = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd) >> 20;
  const uint32_t r = u < (121u << 23) ? sub : norm;
  return uint8_t(r | (sign >> 24));
}

struct Table {  // e4m3fn code -> fp32 (c10's conversion, as torch's .float())
  float v[256];
  Table() { for (int i = 0; i < 256; ++i) v[i] = float(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits())); }
};
const Table& table() { static const Table t; return t; }

// The least e with absmax <= 448 * 2^e, clamped to [-126, 127] (store/moments.block_exponents).
inline int block_exponent(float absmax) {
  int ex;
  const float mant = std::frexp(absmax, &ex);
  int e = ex - 9 + (mant > 0.875f ? 1 : 0);
  return e < -126 ? -126 : (e > 127 ? 127 : e);
}

inline float bf16_float(uint16_t b) { return float_of(uint32_t(b) << 16); }
inline uint16_t bf16_rne(float f) {  // as adamw_cpp.cpp's float_to_bf16 (torch's cast)
  if (std::isnan(f)) return 0xFFFF;
  const uint32_t u = bits_of(f);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void load_row(float* out, const float* p, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = p[i]; }
inline void load_row(float* out, const uint16_t* p, int64_t n) { for (int64_t i = 0; i < n; ++i) out[i] = bf16_float(p[i]); }
inline void store_row(float* p, const float* x, int64_t n) { for (int64_t i = 0; i < n; ++i) p[i] = x[i]; }
inline void store_row(uint16_t* p, const float* x, int64_t n) { for (int64_t i = 0; i < n; ++i) p[i] = bf16_rne(x[i]); }

// The Adam arithmetic over one block's local buffers (p, g widened; m, v decoded): state_adamw.adam_math.
// `sq` receives sqrt(v), which int8 codes.
__attribute__((target_clones("avx2", "default")))
void adam_block(float* p, const float* g0, float* m, float* v, float* sq, int64_t n, int64_t decayed,
                const StateConsts k) {
  for (int64_t i = 0; i < n; ++i) {
    float g = g0[i];
    if (k.scaled) g = g / k.inv_clip;
    const float mv = m[i] + (g - m[i]) * k.w1;
    const float vv = v[i] * k.beta2 + (g * g) * k.c2;
    const float s = std::sqrt(vv);
    float pv = p[i];
    if (i < decayed) pv = pv * k.decay;
    p[i] = pv + (mv * k.neg_step) / (s / k.bc2s + k.eps);
    m[i] = mv;
    v[i] = vv;
    sq[i] = s;
  }
}

__attribute__((target_clones("avx2", "default")))
void sr_bf16(uint16_t* out, const float* x, int64_t n, uint32_t key, uint32_t first) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t noise = mix32(key ^ (first + uint32_t(i))) & 0xFFFFu;
    out[i] = uint16_t((bits_of(x[i]) + noise) >> 16);  // the magnitude carries; the sign bit is untouched
  }
}

__attribute__((target_clones("avx2", "default")))
void code_block(uint8_t* out, int8_t* exp, const float* x, int64_t n) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::fmax(absmax, std::fabs(x[i]));
  const int e = block_exponent(absmax);
  *exp = int8_t(e);
  const float inv = std::ldexp(1.0f, -e);  // exact scaling: a power of two
  for (int64_t i = 0; i < n; ++i) out[i] = to_e4m3(x[i] * inv);
}

inline void decode_block(float* out, const uint8_t* q, int8_t exp, int64_t n, bool square) {
  const float* t = table().v;
  const float s = std::ldexp(1.0f, exp);
  for (int64_t i = 0; i < n; ++i) {
    const float x = t[q[i]] * s;
    out[i] = square ? x * x : x;
  }
}

template <typename P, typename G>
void run_state(P* p, const G* gp, void* m, void* v, int8_t* me, int8_t* ve, int64_t numel, bool int8,
               int64_t decay_numel, uint32_t origin, uint32_t key_m, uint32_t key_v, const StateConsts& k) {
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    float pb[kBlock], gb[kBlock], mb[kBlock], vb[kBlock], sb[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, n = std::min(kBlock, numel - lo);
      load_row(pb, p + lo, n);
      load_row(gb, gp + lo, n);
      if (int8) {
        decode_block(mb, static_cast<const uint8_t*>(m) + lo, me[b], n, false);
        decode_block(vb, static_cast<const uint8_t*>(v) + lo, ve[b], n, true);
      } else {
        load_row(mb, static_cast<const uint16_t*>(m) + lo, n);
        load_row(vb, static_cast<const uint16_t*>(v) + lo, n);
      }
      const int64_t decayed = std::min(n, std::max<int64_t>(0, decay_numel - lo));
      adam_block(pb, gb, mb, vb, sb, n, decayed, k);
      store_row(p + lo, pb, n);
      if (int8) {
        code_block(static_cast<uint8_t*>(m) + lo, me + b, mb, n);
        code_block(static_cast<uint8_t*>(v) + lo, ve + b, sb, n);
      } else {
        sr_bf16(static_cast<uint16_t*>(m) + lo, mb, n, key_m, origin + uint32_t(lo));
        sr_bf16(static_cast<uint16_t*>(v) + lo, vb, n, key_v, origin + uint32_t(lo));
      }
    }
  });
}

}  // namespace

void adamw_state_update(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                        at::Tensor exp_avg_exp, at::Tensor exp_avg_sq_exp, double step, double lr, double beta1,
                        double beta2, double eps, double weight_decay, double clip, int64_t decay_numel,
                        int64_t origin, int64_t key_m, int64_t key_v) {
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
  void* m = exp_avg.data_ptr();
  void* v = exp_avg_sq.data_ptr();
  int8_t* me = int8 ? exp_avg_exp.data_ptr<int8_t>() : nullptr;
  int8_t* ve = int8 ? exp_avg_sq_exp.data_ptr<int8_t>() : nullptr;
  const bool g16 = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  const uint32_t o = uint32_t(origin), km = uint32_t(key_m), kv = uint32_t(key_v);
  table();  // built once, before the threads read it
  pybind11::gil_scoped_release no_gil;
  auto over = [&](auto* p) {
    if (g16) run_state(p, static_cast<const uint16_t*>(g), m, v, me, ve, numel, int8, decay_numel, o, km, kv, k);
    else run_state(p, static_cast<const float*>(g), m, v, me, ve, numel, int8, decay_numel, o, km, kv, k);
  };
  if (master.scalar_type() == at::kBFloat16) over(reinterpret_cast<uint16_t*>(master.data_ptr()));
  else over(master.data_ptr<float>());
}
