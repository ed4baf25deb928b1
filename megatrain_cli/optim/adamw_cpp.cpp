// The host AdamW kernel: torch's fused CPU AdamW, one pass over each flat section, reading bf16
// gradients directly; the weights are fp32 masters, or bf16 ones (train.master_weights: widened in
// registers, the update computed in fp32, the new weight stored rounded to nearest even, or stochastically
// with train.master_rounding: the bits of rounding.h, keyed per tile and step, indexed by element). Loaded (compiled at first use) by adamw_cpp.py, whose docstring says what each
// entry point computes and costs, and how it stays bit-identical to torch._fused_adamw_.
// Every entry point releases the GIL while it runs, as torch's own ops do: the optimizer worker thread
// runs it beside the training thread.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

#include "rounding.h"

namespace {

constexpr int64_t kUnit = 1024;       // elements per parallel unit (4 KiB of fp32, 64-byte aligned)
constexpr int64_t kGrainUnits = 64;   // at least 64K elements per thread

struct Consts {
  float beta2, w1, w1m1, c2, bc2s, eps, neg_step, decay, scale;
  bool small_lerp, wd, scaled;
  bool sr = false;  // bf16 masters rounded stochastically with `key` (rounding.h); else to nearest even
  uint32_t key = 0;
};

Consts make_consts(double step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, double clip) {
  // As torch's FusedAdamKernel.cpp: scalars in double, rounded to fp32 where they enter the math.
  Consts k;
  const double bc1 = 1 - std::pow(beta1, step);
  const double bc2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bc1;
  k.beta2 = float(beta2);
  k.w1 = float(1 - beta1);
  k.w1m1 = k.w1 - 1.0f;
  k.c2 = float(1 - beta2);
  k.bc2s = float(std::sqrt(bc2));
  k.eps = float(eps);
  k.neg_step = float(-step_size);
  k.decay = float(1 - lr * weight_decay);
  k.wd = weight_decay != 0.0;
  k.small_lerp = std::abs(k.w1) < 0.5f;
  k.scaled = clip != 1.0;
  k.scale = float(1.0 / clip);  // torch's grad_scale tensor is fp32(1 / clip); the grad is divided by it
  return k;
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// A gradient or weight element as fp32: G (P) is float, or uint16_t holding bf16 bits.
template <typename G> inline float load_g(const G* g, int64_t i);
template <> inline float load_g<float>(const float* g, int64_t i) { return g[i]; }
template <> inline float load_g<uint16_t>(const uint16_t* g, int64_t i) { return bf16_to_float(g[i]); }

// fp32 -> bf16, round to nearest even, as torch's CPU cast (copy_) stores it: its vectorised
// conversion, which also covers the tails, writes a NaN as 0xFFFF (c10::BFloat16's scalar one would
// write 0x7FC0).
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0xFFFF;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Store a new weight: an fp32 master as it is, a bf16 master rounded as float_to_bf16 or stochastically from
// the bits of element `at` (its index in the whole tile).
inline void store_p(float* p, int64_t i, float x, const Consts&, uint32_t) { p[i] = x; }
inline void store_p(uint16_t* p, int64_t i, float x, const Consts& k, uint32_t at) {
  p[i] = k.sr ? megatrain::bf16_sr(x, k.key, at) : float_to_bf16(x);
}
// The bf16 weight the layer computes with: a bf16 master's stored bits, an fp32 master's cast.
inline uint16_t emitted(const float*, int64_t, float x) { return float_to_bf16(x); }
inline uint16_t emitted(const uint16_t* p, int64_t i, float) { return p[i]; }

// ---------------------------------------------------------------- scalar (any CPU; also the tails)
// kTail: the formula of torch's scalar tail (the last numel % 8 elements of a call), whose build
// contracts the v update differently from its vector loop.
// What an update pass stores: everything (kFull), the weight only (kWeights), the moments only (kMoments).
enum Mode { kFull = 0, kWeights = 1, kMoments = 2 };

// `out` (kWeights only; nullptr: none): the new weights' bf16 cast is stored there too. `first`: the index of
// element 0 in the whole tile (stochastic rounding's bits).
template <int kMode = kFull, bool kTail = false, typename P, typename G>
inline void update_scalar(P* p, const G* gp, float* m, float* v, int64_t n, const Consts& k, uint32_t first,
                          uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    float g = load_g(gp, i);
    if (k.scaled) g = g / k.scale;
    float mv = m[i];
    mv = k.small_lerp ? std::fma(k.w1, g - mv, mv) : std::fma(k.w1m1, g - mv, g);
    // torch's build contracts these (the vector loop's and the tail's differently) to FMAs
    float vv = kTail ? std::fma(v[i], k.beta2, (k.c2 * g) * g) : std::fma(k.c2 * g, g, v[i] * k.beta2);
    if constexpr (kMode != kWeights) {
      m[i] = mv;
      v[i] = vv;
    }
    if constexpr (kMode != kMoments) {
      float pv = load_g(p, i);
      if (k.wd) pv = pv * k.decay;
      float d = std::sqrt(vv) / k.bc2s + k.eps;
      pv = pv + (k.neg_step * mv) / d;
      store_p(p, i, pv, k, first + uint32_t(i));
      if (kMode == kWeights && out != nullptr) out[i] = emitted(p, i, pv);
    }
  }
}

template <typename G>
inline void correct_scalar(float* p, const G* gp, float* m, float* v, int64_t n, const Consts& k) {
  for (int64_t i = 0; i < n; ++i) {
    float g = load_g(gp, i);
    float gc = g / k.scale;
    float m1 = m[i], v1 = v[i];
    float a1 = (k.neg_step * m1) / (std::sqrt(v1) / k.bc2s + k.eps);  // the step update(1) took
    float mc = std::fma(k.w1, gc - g, m1);
    float vc = std::fma(k.c2, (gc - g) * (gc + g), v1);
    vc = vc < 0.0f ? 0.0f : vc;
    float ac = (k.neg_step * mc) / (std::sqrt(vc) / k.bc2s + k.eps);  // the step update(c) takes
    m[i] = mc;
    v[i] = vc;
    p[i] = (p[i] - a1) + ac;  // p[i] - a1 recovers the decayed weight, mostly exactly
  }
}

// ---------------------------------------------------------------- AVX2 + FMA
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* g) { return _mm256_loadu_ps(g); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* g) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 fp32 -> 8 bf16 (round to nearest even; a NaN becomes 0xFFFF, as float_to_bf16).
__attribute__((target("avx2,fma"))) inline void store_bf16x8(uint16_t* out, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
  // values fit 16 bits: the unsigned-saturating pack keeps them; it packs within 128-bit lanes, so
  // gather quadwords 0 and 2 into the low half
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// store_p and emitted, 8 lanes
__attribute__((target("avx2,fma"))) inline void store8(float* p, __m256 x, const Consts&, uint32_t) {
  _mm256_storeu_ps(p, x);
}
__attribute__((target("avx2,fma"))) inline void store8(uint16_t* p, __m256 x, const Consts& k, uint32_t at) {
  if (!k.sr) return store_bf16x8(p, x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(megatrain::bf16_sr8(x, k.key, at),
                                                                      _mm256_setzero_si256()), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
__attribute__((target("avx2,fma"))) inline void emit8(uint16_t* out, const float*, __m256 x) { store_bf16x8(out, x); }
__attribute__((target("avx2,fma"))) inline void emit8(uint16_t* out, const uint16_t* p, __m256) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int kMode, typename P, typename G>
__attribute__((target("avx2,fma"))) void update_avx2(P* p, const G* gp, float* m, float* v,
                                                    int64_t n, const Consts& k, uint32_t first, uint16_t* out) {
  const __m256 beta2 = _mm256_set1_ps(k.beta2), w1 = _mm256_set1_ps(k.w1), w1m1 = _mm256_set1_ps(k.w1m1);
  const __m256 c2 = _mm256_set1_ps(k.c2), bc2s = _mm256_set1_ps(k.bc2s), eps = _mm256_set1_ps(k.eps);
  const __m256 neg_step = _mm256_set1_ps(k.neg_step), decay = _mm256_set1_ps(k.decay);
  const __m256 scale = _mm256_set1_ps(k.scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g = load8(gp + i);
    if (k.scaled) g = _mm256_div_ps(g, scale);
    __m256 mv = _mm256_loadu_ps(m + i);
    __m256 diff = _mm256_sub_ps(g, mv);
    mv = k.small_lerp ? _mm256_fmadd_ps(w1, diff, mv) : _mm256_fmadd_ps(w1m1, diff, g);
    __m256 vv = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(_mm256_loadu_ps(v + i), beta2));
    if constexpr (kMode != kWeights) {
      _mm256_storeu_ps(m + i, mv);
      _mm256_storeu_ps(v + i, vv);
    }
    if constexpr (kMode != kMoments) {
      __m256 pv = load8(p + i);
      if (k.wd) pv = _mm256_mul_ps(pv, decay);
      __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), bc2s), eps);
      pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(neg_step, mv), d));
      store8(p + i, pv, k, first + uint32_t(i));
      if (kMode == kWeights && out != nullptr) emit8(out + i, p + i, pv);
    }
  }
  update_scalar<kMode>(p + i, gp + i, m + i, v + i, n - i, k, first + uint32_t(i), out == nullptr ? nullptr : out + i);
}

template <typename G>
__attribute__((target("avx2,fma"))) void correct_avx2(float* p, const G* gp, float* m, float* v,
                                                     int64_t n, const Consts& k) {
  const __m256 w1 = _mm256_set1_ps(k.w1), c2 = _mm256_set1_ps(k.c2), bc2s = _mm256_set1_ps(k.bc2s);
  const __m256 eps = _mm256_set1_ps(k.eps), neg_step = _mm256_set1_ps(k.neg_step);
  const __m256 scale = _mm256_set1_ps(k.scale), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g = load8(gp + i);
    __m256 gc = _mm256_div_ps(g, scale);
    __m256 m1 = _mm256_loadu_ps(m + i), v1 = _mm256_loadu_ps(v + i);
    __m256 a1 = _mm256_div_ps(_mm256_mul_ps(neg_step, m1),
                              _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), bc2s), eps));
    __m256 mc = _mm256_fmadd_ps(w1, _mm256_sub_ps(gc, g), m1);
    __m256 vc = _mm256_fmadd_ps(c2, _mm256_mul_ps(_mm256_sub_ps(gc, g), _mm256_add_ps(gc, g)), v1);
    vc = _mm256_max_ps(zero, vc);  // a NaN stays NaN (maxps returns its second operand), as clamp_min_
    __m256 ac = _mm256_div_ps(_mm256_mul_ps(neg_step, mc),
                              _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vc), bc2s), eps));
    _mm256_storeu_ps(m + i, mc);
    _mm256_storeu_ps(v + i, vc);
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), a1), ac));
  }
  correct_scalar(p + i, gp + i, m + i, v + i, n - i, k);
}

bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

void check(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq) {
  TORCH_CHECK(master.device().is_cpu() && master.is_contiguous() &&
              (master.scalar_type() == at::kFloat || master.scalar_type() == at::kBFloat16),
              "master must be a contiguous fp32 or bf16 CPU tensor");
  for (const at::Tensor* t : {&exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "exp_avg/exp_avg_sq must be contiguous fp32 CPU tensors");
    TORCH_CHECK(t->numel() == master.numel(), "sections must have the same numel");
  }
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == master.numel(),
              "grad must be a contiguous CPU tensor of the same numel");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "grad must be fp32 or bf16");
}

// kOp: an update Mode, or kCorrect.
constexpr int kCorrect = 3;

// The vector formula runs over the first `n` elements, torch's scalar-tail formula over the rest.
// torch's kernel runs vector code over all but the last numel % tail_width elements of a call (its
// threads' ranges are multiples of 16 elements); those go through its scalar tail.
int64_t vector_numel(int64_t numel, int64_t tail_width) {
  return tail_width > 0 ? numel - numel % tail_width : numel;
}

// `first`: the index of the section's element 0 in the whole tile (stochastic rounding of bf16 masters).
template <int kOp>
void run(at::Tensor& master, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
         const Consts& k, int64_t n, uint16_t* out = nullptr, uint32_t first = 0) {
  check(master, grad, exp_avg, exp_avg_sq);
  const int64_t numel = master.numel();
  if (numel == 0) return;
  if (kOp == kCorrect) n = numel;
  // correct's algebra recovers the old weight from the new one: a rounded (bf16) weight cannot give it back
  TORCH_CHECK(kOp != kCorrect || master.scalar_type() == at::kFloat, "correct needs fp32 master weights");
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const bool bf16 = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  const bool avx2 = has_avx2();
  const int64_t units = (n + kUnit - 1) / kUnit;
  // P: the master's element type (float, or uint16_t holding bf16); the fp32 instantiation is the code
  // this kernel always ran.
  auto over = [&](auto* p) {
    at::parallel_for(0, units, kGrainUnits, [&](int64_t u0, int64_t u1) {
      const int64_t lo = u0 * kUnit, hi = std::min(n, u1 * kUnit);
      auto* pp = p + lo;
      float *mm = m + lo, *vv = v + lo;
      uint16_t* oo = out == nullptr ? nullptr : out + lo;
      const int64_t len = hi - lo;
      auto pass = [&](const auto* gg) {
        if constexpr (kOp == kCorrect) {
          if constexpr (std::is_same_v<std::remove_pointer_t<decltype(pp)>, float>) {
            if (avx2) correct_avx2(pp, gg, mm, vv, len, k); else correct_scalar(pp, gg, mm, vv, len, k);
          }
        } else {
          const uint32_t at = first + uint32_t(lo);
          if (avx2) update_avx2<kOp>(pp, gg, mm, vv, len, k, at, oo);
          else update_scalar<kOp>(pp, gg, mm, vv, len, k, at, oo);
        }
      };
      if (bf16) pass(static_cast<const uint16_t*>(g) + lo);
      else      pass(static_cast<const float*>(g) + lo);
    });
    if constexpr (kOp != kCorrect) {
      if (n < numel) {
        uint16_t* ot = out == nullptr ? nullptr : out + n;
        const uint32_t at = first + uint32_t(n);
        if (bf16) update_scalar<kOp, true>(p + n, static_cast<const uint16_t*>(g) + n, m + n, v + n, numel - n, k, at, ot);
        else      update_scalar<kOp, true>(p + n, static_cast<const float*>(g) + n, m + n, v + n, numel - n, k, at, ot);
      }
    }
  };
  if (master.scalar_type() == at::kBFloat16) over(reinterpret_cast<uint16_t*>(master.data_ptr()));
  else over(master.data_ptr<float>());
}

}  // namespace

// key_p >= 0: bf16 masters rounded stochastically with that key, element 0 being element `first` of the tile.
Consts with_rounding(Consts k, int64_t key_p) {
  k.sr = key_p >= 0;
  k.key = uint32_t(key_p);
  return k;
}

void adamw_update(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                  double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                  double clip, int64_t tail_width, int64_t key_p, int64_t first) {
  TORCH_CHECK(clip > 0.0, "clip coefficient must be > 0");
  Consts k = with_rounding(make_consts(step, lr, beta1, beta2, eps, weight_decay, clip), key_p);
  pybind11::gil_scoped_release no_gil;  // as torch's own ops: the training thread runs meanwhile
  run<kFull>(master, grad, exp_avg, exp_avg_sq, k, vector_numel(master.numel(), tail_width), nullptr,
             uint32_t(first));
}

void adamw_weights(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                   double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   double clip, int64_t tail_width, int64_t key_p, int64_t first) {
  TORCH_CHECK(clip > 0.0, "clip coefficient must be > 0");
  Consts k = with_rounding(make_consts(step, lr, beta1, beta2, eps, weight_decay, clip), key_p);
  pybind11::gil_scoped_release no_gil;
  run<kWeights>(master, grad, exp_avg, exp_avg_sq, k, vector_numel(master.numel(), tail_width), nullptr,
                uint32_t(first));
}

void adamw_weights_emit(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                        at::Tensor out, double step, double lr, double beta1, double beta2, double eps,
                        double weight_decay, double clip, int64_t vector_numel, int64_t key_p, int64_t first) {
  // adamw_weights over a piece of a section, also storing the new weights' bf16 cast in `out`. The
  // caller says how many leading elements take the vector formula: the rest are in the section's tail.
  TORCH_CHECK(clip > 0.0, "clip coefficient must be > 0");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
              out.numel() == master.numel(), "out must be a contiguous bf16 CPU tensor of the same numel");
  TORCH_CHECK(vector_numel >= 0 && vector_numel <= master.numel(), "vector_numel out of range");
  Consts k = with_rounding(make_consts(step, lr, beta1, beta2, eps, weight_decay, clip), key_p);
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  pybind11::gil_scoped_release no_gil;
  run<kWeights>(master, grad, exp_avg, exp_avg_sq, k, vector_numel, o, uint32_t(first));
}

void adamw_moments(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                   double beta1, double beta2, double clip, int64_t tail_width) {
  // `master` is only checked (same numel), never read: the moments do not depend on the weight.
  TORCH_CHECK(clip > 0.0, "clip coefficient must be > 0");
  Consts k = make_consts(1.0, 0.0, beta1, beta2, 1e-8, 0.0, clip);
  pybind11::gil_scoped_release no_gil;
  run<kMoments>(master, grad, exp_avg, exp_avg_sq, k, vector_numel(master.numel(), tail_width));
}

void adamw_correct(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                   double step, double lr, double beta1, double beta2, double eps, double clip) {
  TORCH_CHECK(clip > 0.0, "clip coefficient must be > 0");
  Consts k = make_consts(step, lr, beta1, beta2, eps, 0.0, clip);
  pybind11::gil_scoped_release no_gil;
  run<kCorrect>(master, grad, exp_avg, exp_avg_sq, k, master.numel());
}

bool uses_avx2() { return has_avx2(); }

// adamw_state.cpp: AdamW over bf16 or int8 moments (train.optimizer_state)
void adamw_state_update(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                        at::Tensor exp_avg_exp, at::Tensor exp_avg_sq_exp, double step, double lr, double beta1,
                        double beta2, double eps, double weight_decay, double clip, int64_t decay_numel,
                        int64_t origin, int64_t key_m, int64_t key_v, int64_t key_p);

// The bindings load_inline generated: torch::wrap_pybind_function turns a TORCH_CHECK failure into
// the Python exception torch's own ops raise.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_update", torch::wrap_pybind_function(adamw_update), "adamw_update");
  m.def("adamw_correct", torch::wrap_pybind_function(adamw_correct), "adamw_correct");
  m.def("adamw_weights", torch::wrap_pybind_function(adamw_weights), "adamw_weights");
  m.def("adamw_weights_emit", torch::wrap_pybind_function(adamw_weights_emit), "adamw_weights_emit");
  m.def("adamw_moments", torch::wrap_pybind_function(adamw_moments), "adamw_moments");
  m.def("adamw_state_update", torch::wrap_pybind_function(adamw_state_update), "adamw_state_update");
  m.def("uses_avx2", torch::wrap_pybind_function(uses_avx2), "uses_avx2");
}
