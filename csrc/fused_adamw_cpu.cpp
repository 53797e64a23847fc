// CPU kernel of zero_ext::fused_adamw_: one AdamW step over S segments of any number of
// param groups, in ONE parallel loop.
//
// Work split: the S segments are laid end to end in one virtual element space [0, N);
// at::parallel_for cuts that space into one contiguous range per thread, so the threads get
// equal numbers of elements whatever the mix of tensor sizes and groups (no parallel region
// per tensor, no per-group launch). Each thread walks the segments its range overlaps.
//
// Arithmetic as in docs/design.md, "AdamW arithmetic": per-segment scalars in double, cast
// to float once; per element fp32 math, state stored in the param dtype or in fp32.
//
// Mixed precision: a bf16/fp16 segment with a float32 master runs on the master (fp32 state);
// an element whose param no longer holds the master's rounding takes the param's value first.
//
// Vectorization: fp32 params with fp32 state (the common case) run one pass of explicit
// AVX-512 or AVX2 vectors, chosen at run time. The other dtype mixes (bf16/fp16 params, state
// in the param dtype or fp32, with or without a master) run plain C++ loops that the compiler
// vectorizes; the shipped build (no -march) gets runtime ISA dispatch for them via GCC
// target_clones on x86-64. Those loops take a separate sqrt pass over a small L1-resident
// block, because with -fmath-errno (GCC's default) a sqrt call inside a loop stops the loop
// from being vectorized.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fused_adamw_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ZX_X86 1
#else
#define ZX_X86 0
#endif

// Runtime ISA dispatch for the element loops (GCC and clang on x86-64 with ifunc support), for
// builds that target a generic x86-64 (setup.py). A build that already targets a newer ISA
// (the JIT build passes -march=native) compiles the loops for it directly: clones of a lower
// level than the file's own target could not inline the helpers below.
#if defined(__clang__)
#define ZX_CLONES_OK (__clang_major__ >= 14)
#elif defined(__GNUC__)
#define ZX_CLONES_OK (__GNUC__ >= 12)  // target_clones("arch=...") needs GCC 12
#else
#define ZX_CLONES_OK 0
#endif
#if ZX_X86 && defined(__linux__) && !defined(__AVX2__) && ZX_CLONES_OK
#define ZX_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZX_CLONES
#endif

#if defined(__GNUC__)
#define ZX_INLINE static inline __attribute__((always_inline))
#else
#define ZX_INLINE static inline
#endif

namespace zero_ext {
namespace {

using adamw::kCols;
constexpr int64_t kBlock = 512;  // elements per inner block (temporaries stay in L1)
constexpr int64_t kGrain = 32768;  // below this many elements in total: one thread

using adamw::kF32;
using adamw::kBF16;
using adamw::kF16;
using adamw::kind_of;

// ---- element conversions (inline, branch-free, so loops vectorize) -----------------------
struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };
ZX_INLINE uint32_t raw(bf16_t v) { return v.x; }
ZX_INLINE uint32_t raw(f16_t v) { return v.x; }

ZX_INLINE float to_f(float v) { return v; }
ZX_INLINE float to_f(bf16_t v) {
  uint32_t b = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
ZX_INLINE void from_f(float* dst, float v) { *dst = v; }
ZX_INLINE void from_f(bf16_t* dst, float v) {
  // Round to nearest even, NaN -> quiet NaN (same as c10::BFloat16).
  uint32_t b;
  std::memcpy(&b, &v, 4);
  uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  dst->x = uint16_t(v != v ? 0x7FC0u : r);
}
// IEEE half <-> float without branches (selects only), so the loops vectorize on any ISA;
// exact for every half value and round-to-nearest-even like c10::Half, NaN stays NaN.
ZX_INLINE uint32_t f_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
ZX_INLINE float bits_f(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
// cond ? a : b on bit patterns, written with masks so that the compiler keeps every operand
// computed (no branch, no sinking of float math into one side) and the loop vectorizes.
ZX_INLINE uint32_t pick(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - uint32_t(cond);
  return (a & mask) | (b & ~mask);
}
ZX_INLINE float to_f(f16_t v) {
  const uint32_t h = v.x;
  const uint32_t body = (h & 0x7FFFu) << 13;  // exponent and mantissa, float-aligned
  const uint32_t hexp = h & 0x7C00u;
  // normal: rebias the exponent by 127 - 15; Inf/NaN: exponent field all ones.
  const uint32_t normal = body + (112u << 23);
  const uint32_t special = body | 0x7F800000u;
  // zero/subnormal: m * 2^-24, computed exactly as (2^-14 + m * 2^-24) - 2^-14.
  const float sub = bits_f(body + (113u << 23)) - bits_f(113u << 23);
  uint32_t out = pick(hexp == 0x7C00u, special, normal);
  out = pick(hexp == 0, f_bits(sub), out);
  return bits_f(out | ((h & 0x8000u) << 16));
}
ZX_INLINE void from_f(f16_t* dst, float v) {
  const uint32_t b = f_bits(v);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7FFFFFFFu;  // |v|
  // |v| >= 65536 (or Inf/NaN): Inf, or a quiet NaN.
  const uint32_t big = pick(a > 0x7F800000u, 0x7E00u, 0x7C00u);
  // |v| < 2^-14: the result is subnormal or zero; adding 0.5 makes the FPU round the
  // mantissa at bit 2^-24 (to nearest even), then the low bits are the half's bits.
  const uint32_t small = f_bits(bits_f(a) + 0.5f) - f_bits(0.5f);
  // normal: rebias, then round to nearest even at bit 13 by integer addition (a carry into
  // the exponent is right, up to Inf).
  const uint32_t rebias = a - (112u << 23);
  const uint32_t normal = (rebias + 0x0FFFu + ((rebias >> 13) & 1u)) >> 13;
  uint32_t out = pick(a >= (143u << 23), big, normal);
  out = pick(a < (113u << 23), small, out);
  dst->x = uint16_t(out | sign);
}

// Float scalars of one segment, computed once in double (docs/design.md, "AdamW arithmetic").
struct Scalars {
  float decay;       // 1 - lr * wd
  float lerp_w;      // weight of lerp(m, g, 1 - beta1), as torch's lerp uses it
  int lerp_lo;       // torch's lerp: weight < 0.5 ? m + w*(g-m) : g - (g-m)*(1-w)
  float beta2;
  float one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float grad_mul;       // -1 when maximize, else 1
  float grad_div;       // grad_scale, or 1
};

struct Segment {
  void* p;
  const void* g;
  void* m;
  void* v;
  void* vmax;  // null unless amsgrad
  float* w;    // the float32 master, or null
  int64_t numel;
  int pkind;
  int skind;
  Scalars sc;
};

// ---- the element loop ------------------------------------------------------------------
ZX_INLINE void sqrt_inplace(float* t, int64_t n) {
  int64_t i = 0;
#if ZX_X86 && defined(__AVX512F__)  // a build for this machine (-march=native)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(t + i, _mm512_sqrt_ps(_mm512_loadu_ps(t + i)));
#elif ZX_X86 && defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(t + i, _mm256_sqrt_ps(_mm256_loadu_ps(t + i)));
#endif
#if ZX_X86  // SSE is in every x86-64 target, so also in every target_clones variant
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(t + i, _mm_sqrt_ps(_mm_loadu_ps(t + i)));
#endif
  for (; i < n; ++i) t[i] = std::sqrt(t[i]);
}

// MW: the segment has a float32 master (PT bf16/fp16, ST float); the update runs on it.
// SC: the grads are divided by grad_div (a GradScaler's scale, a clip); without, that
// division by 1 (exact) is left out: a vector division costs as much as the rest of the
// element's arithmetic on some CPUs.
template <typename PT, typename ST, bool AMS, bool MW, bool SC>
ZX_INLINE void adamw_range(
    const Segment& s, int64_t begin, int64_t end) {
  PT* __restrict p = static_cast<PT*>(s.p) + begin;
  const PT* __restrict g = static_cast<const PT*>(s.g) + begin;
  ST* __restrict m = static_cast<ST*>(s.m) + begin;
  ST* __restrict v = static_cast<ST*>(s.v) + begin;
  ST* __restrict vmax = AMS ? static_cast<ST*>(s.vmax) + begin : nullptr;
  float* __restrict w = MW ? s.w + begin : nullptr;
  const Scalars c = s.sc;
  alignas(64) float m32[kBlock];
  alignas(64) float den[kBlock];
  const int64_t n = end - begin;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - b0);
    // Pass 1: moments (reads g, m, v[, vmax]; writes m, v[, vmax]).
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t j = b0 + i;
      const float gi = SC ? to_f(g[j]) * c.grad_mul / c.grad_div : to_f(g[j]) * c.grad_mul;
      const float mi = to_f(m[j]);
      const float base = c.lerp_lo ? mi : gi;
      const float mn = base + c.lerp_w * (gi - mi);
      const float vn = to_f(v[j]) * c.beta2 + c.one_minus_beta2 * gi * gi;
      from_f(&m[j], mn);
      from_f(&v[j], vn);
      m32[i] = mn;
      if (AMS) {
        const float old = to_f(vmax[j]);
        const float mx = bits_f(pick((old > vn) | (old != old), f_bits(old), f_bits(vn)));  // NaN wins, as torch.maximum
        from_f(&vmax[j], mx);
        den[i] = mx;
      } else {
        den[i] = vn;
      }
    }
    // Pass 2: sqrt of the block (SSE; errno-free).
    sqrt_inplace(den, nb);
    // Pass 3: decoupled weight decay and the update.
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t j = b0 + i;
      const float d = den[i] / c.bc2_sqrt + c.eps;
      if constexpr (MW) {
        // The param is the source of truth: one written by someone else since the last step
        // (its bits differ from the master's rounding) replaces the master.
        const float wj = w[j];
        PT r;
        from_f(&r, wj);
        const float cur = bits_f(pick(raw(r) != raw(p[j]), f_bits(to_f(p[j])), f_bits(wj)));
        const float pn = cur * c.decay + c.neg_step_size * m32[i] / d;
        w[j] = pn;
        from_f(&p[j], pn);
      } else {
        const float pd = to_f(p[j]) * c.decay;
        from_f(&p[j], pd + c.neg_step_size * m32[i] / d);
      }
    }
  }
}

#define ZX_DEFINE_KERNEL(NAME, PT, ST, AMS, MW)                                   \
  ZX_CLONES void NAME(const Segment& s, int64_t begin, int64_t end) {             \
    if (s.sc.grad_div != 1.0f)                                                    \
      adamw_range<PT, ST, AMS, MW, true>(s, begin, end);                          \
    else                                                                          \
      adamw_range<PT, ST, AMS, MW, false>(s, begin, end);                         \
  }
ZX_DEFINE_KERNEL(k_f32_f32, float, float, false, false)
ZX_DEFINE_KERNEL(k_f32_f32_ams, float, float, true, false)
ZX_DEFINE_KERNEL(k_bf16_bf16, bf16_t, bf16_t, false, false)
ZX_DEFINE_KERNEL(k_bf16_bf16_ams, bf16_t, bf16_t, true, false)
ZX_DEFINE_KERNEL(k_bf16_f32, bf16_t, float, false, false)
ZX_DEFINE_KERNEL(k_bf16_f32_ams, bf16_t, float, true, false)
ZX_DEFINE_KERNEL(k_bf16_master, bf16_t, float, false, true)
ZX_DEFINE_KERNEL(k_bf16_master_ams, bf16_t, float, true, true)
ZX_DEFINE_KERNEL(k_f16_f16, f16_t, f16_t, false, false)
ZX_DEFINE_KERNEL(k_f16_f16_ams, f16_t, f16_t, true, false)
ZX_DEFINE_KERNEL(k_f16_f32, f16_t, float, false, false)
ZX_DEFINE_KERNEL(k_f16_f32_ams, f16_t, float, true, false)
ZX_DEFINE_KERNEL(k_f16_master, f16_t, float, false, true)
ZX_DEFINE_KERNEL(k_f16_master_ams, f16_t, float, true, true)
#undef ZX_DEFINE_KERNEL

// ---- fp32 params and state: one pass with explicit AVX-512 / AVX2 vectors ----------------
// The portable loops above need three passes per block (the sqrt pass in between); for the
// common fp32 case an explicit single pass keeps all four input streams in flight together,
// which measured about 10% faster on large tensors. Tails use masked loads and stores, so every
// element gets the same arithmetic wherever it sits (a range split never changes a result).
#if ZX_X86 && defined(__GNUC__)
#define ZX_HAVE_SIMD_F32 1

struct Avx512Consts {
  __m512 gmul, gdiv, w, b2, omb2, bc2s, eps, dec, nss;
  __mmask16 lo;
};

// One vector of 16 elements (FULL: plain loads and stores; else the tail, masked by k).
template <bool AMS, bool FULL, bool SC>
__attribute__((target("avx512f"), always_inline)) static inline void avx512_vector(
    const Avx512Consts& c, float* p, const float* g, float* m, float* v, float* x,
    __mmask16 k) {
  auto ld = [](const float* a, __mmask16 mask) __attribute__((target("avx512f"),
                                                              always_inline)) {
    return FULL ? _mm512_loadu_ps(a) : _mm512_maskz_loadu_ps(mask, a);
  };
  auto st = [](float* a, __mmask16 mask, __m512 val) __attribute__((target("avx512f"),
                                                                    always_inline)) {
    if (FULL) _mm512_storeu_ps(a, val); else _mm512_mask_storeu_ps(a, mask, val);
  };
  const __m512 gm = _mm512_mul_ps(ld(g, k), c.gmul);
  const __m512 gv = SC ? _mm512_div_ps(gm, c.gdiv) : gm;
  __m512 mv = ld(m, k);
  const __m512 base = _mm512_mask_blend_ps(c.lo, gv, mv);
  mv = _mm512_fmadd_ps(c.w, _mm512_sub_ps(gv, mv), base);
  const __m512 vv = _mm512_add_ps(_mm512_mul_ps(ld(v, k), c.b2),
                                  _mm512_mul_ps(_mm512_mul_ps(c.omb2, gv), gv));
  __m512 vh = vv;
  if (AMS) {
    const __m512 old = ld(x, k);
    const __mmask16 keep = _mm512_cmp_ps_mask(old, vv, _CMP_GT_OQ) |
                           _mm512_cmp_ps_mask(old, old, _CMP_UNORD_Q);
    vh = _mm512_mask_blend_ps(keep, vv, old);
    st(x, k, vh);
  }
  const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vh), c.bc2s), c.eps);
  const __m512 pv = _mm512_add_ps(_mm512_mul_ps(ld(p, k), c.dec),
                                  _mm512_div_ps(_mm512_mul_ps(c.nss, mv), d));
  st(m, k, mv);
  st(v, k, vv);
  st(p, k, pv);
}

template <bool AMS, bool SC>
__attribute__((target("avx512f"))) static void avx512_loop(const Avx512Consts& c, float* p,
                                                           const float* g, float* m,
                                                           float* v, float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    avx512_vector<AMS, true, SC>(c, p + i, g + i, m + i, v + i, AMS ? x + i : nullptr,
                                 __mmask16(0xFFFF));
  if (i < n)
    avx512_vector<AMS, false, SC>(c, p + i, g + i, m + i, v + i, AMS ? x + i : nullptr,
                                  __mmask16((1u << unsigned(n - i)) - 1u));
}

template <bool AMS>
__attribute__((target("avx512f"))) static void avx512_range(const Segment& s, int64_t begin,
                                                            int64_t end) {
  float* p = static_cast<float*>(s.p) + begin;
  const float* g = static_cast<const float*>(s.g) + begin;
  float* m = static_cast<float*>(s.m) + begin;
  float* v = static_cast<float*>(s.v) + begin;
  float* x = AMS ? static_cast<float*>(s.vmax) + begin : nullptr;
  const Scalars sc = s.sc;
  Avx512Consts c;
  c.gmul = _mm512_set1_ps(sc.grad_mul);
  c.gdiv = _mm512_set1_ps(sc.grad_div);
  c.w = _mm512_set1_ps(sc.lerp_w);
  c.b2 = _mm512_set1_ps(sc.beta2);
  c.omb2 = _mm512_set1_ps(sc.one_minus_beta2);
  c.bc2s = _mm512_set1_ps(sc.bc2_sqrt);
  c.eps = _mm512_set1_ps(sc.eps);
  c.dec = _mm512_set1_ps(sc.decay);
  c.nss = _mm512_set1_ps(sc.neg_step_size);
  c.lo = sc.lerp_lo ? __mmask16(0xFFFF) : __mmask16(0);
  const int64_t n = end - begin;
  if (sc.grad_div != 1.0f)
    avx512_loop<AMS, true>(c, p, g, m, v, x, n);
  else
    avx512_loop<AMS, false>(c, p, g, m, v, x, n);
}

__attribute__((target("avx512f"))) void k_f32_avx512(const Segment& s, int64_t b, int64_t e) {
  avx512_range<false>(s, b, e);
}
__attribute__((target("avx512f"))) void k_f32_avx512_ams(const Segment& s, int64_t b,
                                                         int64_t e) {
  avx512_range<true>(s, b, e);
}

// AVX2: full vectors use plain loads and stores; only the tail is masked. (VMASKMOVPS
// stores are microcoded and slow on AMD Zen: masking every vector made this path half as
// fast as the compiler-vectorized loop on such a CPU. Same arithmetic either way.)
struct Avx2Consts {
  __m256 gmul, gdiv, w, b2, omb2, bc2s, eps, dec, nss, lo;
};

template <bool AMS, bool FULL, bool SC>
__attribute__((target("avx2,fma"), always_inline)) static inline void avx2_vector(
    const Avx2Consts& c, float* p, const float* g, float* m, float* v, float* x, __m256i k) {
  auto ld = [](const float* a, __m256i mask) __attribute__((target("avx2,fma"), always_inline)) {
    return FULL ? _mm256_loadu_ps(a) : _mm256_maskload_ps(a, mask);
  };
  auto st = [](float* a, __m256i mask, __m256 val) __attribute__((target("avx2,fma"), always_inline)) {
    if (FULL) _mm256_storeu_ps(a, val); else _mm256_maskstore_ps(a, mask, val);
  };
  const __m256 gm = _mm256_mul_ps(ld(g, k), c.gmul);
  const __m256 gv = SC ? _mm256_div_ps(gm, c.gdiv) : gm;
  __m256 mv = ld(m, k);
  const __m256 base = _mm256_blendv_ps(gv, mv, c.lo);
  mv = _mm256_fmadd_ps(c.w, _mm256_sub_ps(gv, mv), base);
  const __m256 vv = _mm256_add_ps(_mm256_mul_ps(ld(v, k), c.b2),
                                  _mm256_mul_ps(_mm256_mul_ps(c.omb2, gv), gv));
  __m256 vh = vv;
  if (AMS) {
    const __m256 old = ld(x, k);
    const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(old, vv, _CMP_GT_OQ),
                                     _mm256_cmp_ps(old, old, _CMP_UNORD_Q));
    vh = _mm256_blendv_ps(vv, old, keep);
    st(x, k, vh);
  }
  const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vh), c.bc2s), c.eps);
  const __m256 pv = _mm256_add_ps(_mm256_mul_ps(ld(p, k), c.dec),
                                  _mm256_div_ps(_mm256_mul_ps(c.nss, mv), d));
  st(m, k, mv);
  st(v, k, vv);
  st(p, k, pv);
}

template <bool AMS, bool SC>
__attribute__((target("avx2,fma"))) static void avx2_loop(const Avx2Consts& c, float* p,
                                                         const float* g, float* m, float* v,
                                                         float* x, int64_t n) {
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    avx2_vector<AMS, true, SC>(c, p + i, g + i, m + i, v + i, AMS ? x + i : nullptr, all);
  if (i < n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - i)), lane);
    avx2_vector<AMS, false, SC>(c, p + i, g + i, m + i, v + i, AMS ? x + i : nullptr, k);
  }
}

template <bool AMS>
__attribute__((target("avx2,fma"))) static void avx2_range(const Segment& s, int64_t begin,
                                                           int64_t end) {
  float* p = static_cast<float*>(s.p) + begin;
  const float* g = static_cast<const float*>(s.g) + begin;
  float* m = static_cast<float*>(s.m) + begin;
  float* v = static_cast<float*>(s.v) + begin;
  float* x = AMS ? static_cast<float*>(s.vmax) + begin : nullptr;
  const Scalars sc = s.sc;
  Avx2Consts c;
  c.gmul = _mm256_set1_ps(sc.grad_mul);
  c.gdiv = _mm256_set1_ps(sc.grad_div);
  c.w = _mm256_set1_ps(sc.lerp_w);
  c.b2 = _mm256_set1_ps(sc.beta2);
  c.omb2 = _mm256_set1_ps(sc.one_minus_beta2);
  c.bc2s = _mm256_set1_ps(sc.bc2_sqrt);
  c.eps = _mm256_set1_ps(sc.eps);
  c.dec = _mm256_set1_ps(sc.decay);
  c.nss = _mm256_set1_ps(sc.neg_step_size);
  c.lo = _mm256_castsi256_ps(_mm256_set1_epi32(sc.lerp_lo ? -1 : 0));
  const int64_t n = end - begin;
  if (sc.grad_div != 1.0f)
    avx2_loop<AMS, true>(c, p, g, m, v, x, n);
  else
    avx2_loop<AMS, false>(c, p, g, m, v, x, n);
}

__attribute__((target("avx2,fma"))) void k_f32_avx2(const Segment& s, int64_t b, int64_t e) {
  avx2_range<false>(s, b, e);
}
__attribute__((target("avx2,fma"))) void k_f32_avx2_ams(const Segment& s, int64_t b,
                                                        int64_t e) {
  avx2_range<true>(s, b, e);
}

enum Isa : int { kIsaDefault = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };
// The best path this CPU runs; ZERO_EXT_CPU_ISA=avx2|default caps it (tests use it to
// exercise every path on one machine).
static int detect_isa() {
  __builtin_cpu_init();
  int isa = kIsaDefault;
  if (__builtin_cpu_supports("avx512f")) isa = kIsaAvx512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = kIsaAvx2;
  if (const char* cap = std::getenv("ZERO_EXT_CPU_ISA")) {
    if (std::strcmp(cap, "avx2") == 0) isa = std::min<int>(isa, kIsaAvx2);
    else if (std::strcmp(cap, "default") == 0) isa = kIsaDefault;
  }
  return isa;
}
#else
#define ZX_HAVE_SIMD_F32 0
#endif

using KernelFn = void (*)(const Segment&, int64_t, int64_t);

static KernelFn pick_kernel(int pkind, int skind, bool ams, bool master) {
#if ZX_HAVE_SIMD_F32
  static const int isa = detect_isa();
  if (pkind == kF32 && isa == kIsaAvx512) return ams ? k_f32_avx512_ams : k_f32_avx512;
  if (pkind == kF32 && isa == kIsaAvx2) return ams ? k_f32_avx2_ams : k_f32_avx2;
#endif
  if (pkind == kF32) return ams ? k_f32_f32_ams : k_f32_f32;
  if (pkind == kBF16) {
    if (master) return ams ? k_bf16_master_ams : k_bf16_master;
    if (skind == kF32) return ams ? k_bf16_f32_ams : k_bf16_f32;
    return ams ? k_bf16_bf16_ams : k_bf16_bf16;
  }
  if (master) return ams ? k_f16_master_ams : k_f16_master;
  if (skind == kF32) return ams ? k_f16_f32_ams : k_f16_f32;
  return ams ? k_f16_f16_ams : k_f16_f16;
}

// ---- host side: validation and scalars -------------------------------------------------
static Scalars make_scalars(const double* h, double step, double grad_scale) {
  const double lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4];
  const bool maximize = h[6] != 0.0;
  const double bc1 = 1.0 - std::pow(beta1, step);
  const double bc2 = 1.0 - std::pow(beta2, step);
  Scalars s;
  s.decay = float(1.0 - lr * wd);
  const float w = float(1.0 - beta1);
  s.lerp_lo = std::abs(w) < 0.5f;
  s.lerp_w = s.lerp_lo ? w : -(1.0f - w);  // hi branch: g + (-(1-w)) * (g - m)
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.neg_step_size = float(-(lr / bc1));
  s.bc2_sqrt = float(std::sqrt(bc2));
  s.eps = float(eps);
  s.grad_mul = maximize ? -1.0f : 1.0f;
  s.grad_div = float(grad_scale);
  return s;
}

static int64_t bytes_of(int kind) { return kind == kF32 ? 4 : 2; }

static bool follows(const void* a, int64_t n, int64_t size, const void* b) {
  return static_cast<const char*>(a) + n * size == static_cast<const char*>(b);
}

// Whether segment b continues segment a in every tensor's memory, with the same kernel and
// scalars: one segment then (elementwise, the same arithmetic on every element). A rank's
// share laid out in flat buffers (offload_optimizer's host part, params packed by the
// caller) becomes a few long segments, whatever its number of tensors.
static bool continues(const Segment& a, KernelFn fa, const Segment& b, KernelFn fb) {
  if (fa != fb || a.pkind != b.pkind || a.skind != b.skind ||
      std::memcmp(&a.sc, &b.sc, sizeof(Scalars)) != 0) {
    return false;
  }
  const int64_t n = a.numel, ps = bytes_of(a.pkind), ss = bytes_of(a.skind);
  if (!follows(a.p, n, ps, b.p) || !follows(a.g, n, ps, b.g) || !follows(a.m, n, ss, b.m) ||
      !follows(a.v, n, ss, b.v)) {
    return false;
  }
  if ((a.vmax == nullptr) != (b.vmax == nullptr) || (a.w == nullptr) != (b.w == nullptr)) {
    return false;
  }
  return (a.vmax == nullptr || follows(a.vmax, n, ss, b.vmax)) &&
         (a.w == nullptr || follows(a.w, n, 4, b.w));
}

// Appends segment s (kernel fn) to the step's lists, merged into the last one when it
// continues it (`continues`).
static void add_segment(std::vector<Segment>& segs, std::vector<KernelFn>& fns,
                        std::vector<int64_t>& offsets, const Segment& s, KernelFn fn) {
  if (!segs.empty() && continues(segs.back(), fns.back(), s, fn)) {
    segs.back().numel += s.numel;
    offsets.back() += s.numel;
    return;
  }
  segs.push_back(s);
  fns.push_back(fn);
  offsets.push_back(offsets.back() + s.numel);
}

// One parallel loop over the virtual element space of all segments of all groups
// (`offsets`: prefix sums of the segments' numel).
static void run_segments(const std::vector<Segment>& segs, const std::vector<KernelFn>& fns,
                         const std::vector<int64_t>& offsets) {
  const int64_t total = offsets.back();
  if (total == 0) return;
  at::parallel_for(0, total, kGrain, [&](int64_t begin, int64_t end) {
    int64_t k = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    int64_t pos = begin;
    while (pos < end) {
      const int64_t seg_lo = offsets[k], seg_hi = offsets[k + 1];
      const int64_t stop = std::min(end, seg_hi);
      fns[k](segs[k], pos - seg_lo, stop - seg_lo);
      pos = stop;
      ++k;
    }
  });
}

static void check_scalar_tensor(const std::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1,
              "fused_adamw_: ", name, " must be a float32 tensor with one element, got ",
              t->scalar_type(), " with ", t->numel(), " elements");
  TORCH_CHECK(t->device().is_cpu(), "fused_adamw_ (CPU): ", name,
              " must be on the CPU, got ", t->device());
}

}  // namespace

namespace adamw {

void fused_adamw_cpu(const TensorListRef& params, const TensorListRef& grads,
                     const TensorListRef& exp_avgs, const TensorListRef& exp_avg_sqs,
                     const TensorListRef& max_exp_avg_sqs,
                     const at::Tensor& steps, const at::Tensor& segment_groups,
                     const at::Tensor& group_hparams,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const TensorListRef& masters) {
  const int64_t S = adamw::check_list_lengths(params, grads, exp_avgs, exp_avg_sqs,
                                              max_exp_avg_sqs, masters);
  adamw::check_step_args(S, steps, segment_groups, group_hparams, at::Device(at::kCPU));
  check_scalar_tensor(grad_scale, "grad_scale");
  check_scalar_tensor(found_inf, "found_inf");
  if (S == 0) return;
  // A skipped step (found_inf) still checks every segment below: bad inputs are reported
  // whatever the step's verdict, as on CUDA.
  const bool skip = found_inf.has_value() && found_inf->item<float>() != 0.0f;
  const double scale = grad_scale.has_value() ? double(grad_scale->item<float>()) : 1.0;

  const at::Tensor steps_c = steps.contiguous();
  const at::Tensor groups_c = segment_groups.contiguous();
  const at::Tensor hp_c = group_hparams.contiguous();
  const float* step_ptr = steps_c.data_ptr<float>();
  const int64_t* group_ptr = groups_c.data_ptr<int64_t>();
  const double* hp = hp_c.data_ptr<double>();
  const int64_t G = hp_c.size(0);

  std::vector<Segment> segs;
  Scalars last_sc{};
  int64_t last_group = -1;
  float last_step = 0.0f;
  std::vector<KernelFn> fns;
  std::vector<int64_t> offsets;  // prefix sums of the non-empty segments' numel
  segs.reserve(S);
  fns.reserve(S);
  offsets.reserve(S + 1);
  offsets.push_back(0);
  for (int64_t i = 0; i < S; ++i) {
    const at::Tensor& p = params.get(i);
    const at::Tensor& g = grads.get(i);
    const at::Tensor& m = exp_avgs.get(i);
    const at::Tensor& v = exp_avg_sqs.get(i);
    const int64_t gi = group_ptr[i];
    TORCH_CHECK(gi >= 0 && gi < G, "fused_adamw_: segment_groups[", i, "] = ", gi,
                " is out of range for ", G, " groups");
    const double* h = hp + gi * kCols;
    const bool ams = h[5] != 0.0;
    const at::Device cpu(at::kCPU);
    void* vmax_ptr = adamw::check_segment(i, p, g, m, v, max_exp_avg_sqs, gi, ams, cpu);
    float* master_ptr = adamw::check_master(i, p, m, v, masters, cpu);
    const int pk = kind_of(p.scalar_type());
    const int64_t n = p.numel();
    if (n == 0) continue;
    Segment s;
    s.p = p.data_ptr();
    s.g = g.const_data_ptr();
    s.m = m.data_ptr();
    s.v = v.data_ptr();
    s.vmax = vmax_ptr;
    s.w = master_ptr;
    s.pkind = pk;
    s.skind = kind_of(m.scalar_type());
    // Segments of one group mostly share a step: compute each (group, step) once.
    const float step = step_ptr[i];
    if (gi != last_group || !(step == last_step)) {
      last_sc = make_scalars(h, double(step), scale);
      last_group = gi;
      last_step = step;
    }
    s.sc = last_sc;
    s.numel = n;
    add_segment(segs, fns, offsets, s, pick_kernel(pk, s.skind, ams, master_ptr != nullptr));
  }
  if (skip) return;
  run_segments(segs, fns, offsets);
}

void fused_adamw_cpu_plan(const std::vector<PlanSegment>& records,
                          const std::vector<PlanRun>& runs, const void* const* grad_ptrs,
                          const at::Tensor& steps, const at::Tensor& group_hparams,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) {
  check_scalar_tensor(grad_scale, "grad_scale");
  check_scalar_tensor(found_inf, "found_inf");
  if (records.empty()) return;
  if (found_inf.has_value() && found_inf->item<float>() != 0.0f) return;
  const double scale = grad_scale.has_value() ? double(grad_scale->item<float>()) : 1.0;
  const at::Tensor steps_c = steps.contiguous();
  const at::Tensor hp_c = group_hparams.contiguous();
  const float* step_ptr = steps_c.data_ptr<float>();
  const double* hp = hp_c.data_ptr<double>();
  // Per run: its steps compared (contiguous floats) and one record; per record only where a
  // run's segments have different steps. The scalars once per (group, step) run.
  std::vector<Segment> segs;
  std::vector<KernelFn> fns;
  std::vector<int64_t> offsets;
  segs.reserve(runs.size());
  fns.reserve(runs.size());
  offsets.reserve(runs.size() + 1);
  offsets.push_back(0);
  Scalars last_sc{};
  int64_t last_group = -1;
  float last_step = 0.0f;
  auto add = [&](const PlanSegment& r, int64_t numel) {
    Segment sg;
    sg.p = r.p;
    sg.g = grad_ptrs[r.index];
    sg.m = r.m;
    sg.v = r.v;
    sg.vmax = r.vmax;
    sg.w = r.w;
    sg.numel = numel;
    sg.pkind = r.flags & 3;
    sg.skind = (r.flags >> 2) & 3;
    const float step = step_ptr[r.index];
    if (r.group != last_group || !(step == last_step)) {
      last_sc = make_scalars(hp + int64_t(r.group) * kCols, double(step), scale);
      last_group = r.group;
      last_step = step;
    }
    sg.sc = last_sc;
    add_segment(segs, fns, offsets, sg,
                pick_kernel(sg.pkind, sg.skind, (r.flags & kAms) != 0, (r.flags & kMaster) != 0));
  };
  for (const PlanRun& run : runs) {
    bool whole = true;
    if (run.count > 1) {
      const float s0 = step_ptr[run.index_lo];
      for (int64_t i = int64_t(run.index_lo) + 1; i <= int64_t(run.index_hi); ++i) {
        whole &= step_ptr[i] == s0;
      }
    }
    if (whole) {
      add(run.merged, run.merged.numel);
      continue;
    }
    for (int64_t k = run.first; k < int64_t(run.first) + run.count; ++k) {
      add(records[k], records[k].numel);
    }
  }
  run_segments(segs, fns, offsets);
}

}  // namespace adamw
}  // namespace zero_ext

TORCH_LIBRARY_IMPL(zero_ext, CPU, m) {
  m.impl("fused_adamw_", &zero_ext::adamw::fused_adamw_cpu);
}
