// WDE's elementwise CPU kernels, one pass each where PyTorch takes several:
//
// add_layer_norm: LayerNorm(x + residual) for BERT's post-norm blocks (wde/components/models/fused.py): x float32 or
//   bfloat16 (a mixed-precision linear's output), the residual, weight and bias float32, the sum and the statistics
//   in float32 (two passes over the row while it sits in L1), float32 out: what `norm(x + residual)` computes after
//   PyTorch's type promotion, without its separate cast, add and norm passes.
//
// add_rms_norm: RMSNorm(x + residual) * weight for pre-norm decoders (Llama, Qwen2/3, Mistral): x float32 or bfloat16,
//   the residual of x's dtype or float32 (a mixed-precision model's residual stream, x a bfloat16 linear output), the
//   weight either; the sum in the promoted dtype (the new residual, written when a residual is given), its mean
//   square in float32, the normalized row rounded to the sum's dtype, then scaled by the weight in the promoted
//   dtype: what the reference modules compute, in two passes over a row while it sits in L1 instead of PyTorch's
//   seven. Optionally the output in bfloat16 below a float32 result (what the linear layer that takes it would cast
//   it to: one rounding either way) in storage with rows to spare for the layer's padding. x may be a strided view
//   ([A, B, n], the last dimension contiguous). With round_normed false the normalized row is not rounded before
//   the scale (Gemma's RMSNorm: `(x * rsqrt(...) * (1 + w)).to(x.dtype)` in float32).
// norm_add_norm: Gemma 3's sandwich between blocks: the block's output norm, the residual add, the next norm, in one
//   pass over each row (Gemma's RMSNorm: float32, no rounding before the scale, the result in its input's dtype).
// norm_rotary: q or k of a fused q|k|v output ([T, H, d], strided) made ready for attention in one pass over each
//   head's row: Qwen3's per-head RMSNorm (when given a weight), the half-split rotary embedding by [T, d] tables
//   (feature i pairs with i + d/2), the cast to the attention's dtype; each step rounded as the modules that compute
//   it in turn round it (`x * cos + rotate_half(x) * sin`: each product and the sum). Without a weight and with x,
//   the tables and the result of one dtype it is the plain rotary (`apply_rotary`), in one pass instead of six.
// silu_mul: SiLU(gate) * up for gated MLPs (SwiGLU; or the tanh GELU: GeGLU), gate and up the two halves of a
//   fused gate|up projection's output, float32 or bfloat16: the activation rounded to the dtype, then the product,
//   as `act(gate) * up` computes it, in one pass instead of three, into storage with rows to spare for the down
//   projection's padding.
//
// The elementwise halves of WDE's int8 linear layer (wde/components/models/int8_linear.py):
//
// quantize_rows: x [rows, k] (float32 or bfloat16), times an optional per-channel factor (SmoothQuant's 1/s), is
//   quantized per row to u8 with the row's own scale and zero point (asymmetric: the row's min..max onto 0..255), in
//   one read of x and one write of a byte per value, instead of the eight tensor passes PyTorch ops take. The u8
//   rows are allocated to the count the caller rounded them up to (zero past the last row), so the GEMM sees few
//   distinct row counts.
// dequantize_rows_: y [rows, m] float32, the output of oneDNN's u8 x s8 GEMM with the weight scales applied
//   (y = sum_k q[r,k] w[j,k] * wscale[j]), becomes in place
//       y[r, j] = scale[r] * (y[r, j] - zero[r] * colsum[j]) + bias[j]
//   (colsum[j] = sum_k w[j,k] * wscale[j]: the zero point's share), then optionally an activation: GELU (erf, or the
//   tanh approximation) or ReLU, so the activation is fused as oneDNN's post-op is on the float paths.
// dequantize_rows_bf16_: the same, rounded to bfloat16 over the first half of each row of y (a strided bf16 view):
//   for a layer whose output goes straight to an attention that takes bf16 products (the kernel would round it to
//   bf16 as it reads it; rounded here, it reads half the bytes and takes its bf16 path).
// dequantize_quantize_rows_: dequantize_rows_, then each row quantized as quantize_rows would for the int8 layer that
//   takes this one's output (BERT's MLP: up, then down) while the row is still in L1, instead of a later pass that
//   reads the whole output back.
// dequantize_add_layer_norm_: dequantize_rows_, then add_layer_norm with the block's residual, in the norm's first
//   pass (BERT's post-norm after its attention output and MLP down projections), instead of two passes.
// dequantize_add_layer_norm_quantize_: that, then each normed row quantized for the int8 layer the norm's output goes
//   to (the MLP's up projection, the next block's QKV) while the row is in L1, instead of quantize_rows' later pass.
//
// GCC vector types (one register: 16 floats on AVX-512, 8 on AVX2) and polynomial exp (~1 ulp) and erf (~1e-6
// absolute), rows split over torch's intra-op threads. Built for the host's instruction set like the attention kernel.
// Only the headers used (not torch/extension.h, whose parsing was most of a build's time: wde/kernels/cpp_build.py)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include "cpu_exp.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// one vector register's floats: 16 on AVX-512, 8 elsewhere (AVX2). GCC splits a wider vector type into two AVX2
// registers for arithmetic, but lowers its compares, selects and narrowing conversions to scalar code, lane by lane:
// with 16 lanes on an AVX2-only Zen 3, quantize_rows ran at 1.8 GB/s and add_layer_norm at 0.4x PyTorch's own
#if defined(__AVX512F__)
constexpr int64_t VW = 16;
#else
constexpr int64_t VW = 8;
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint16_t vh __attribute__((vector_size(2 * VW)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
typedef uint8_t vb __attribute__((vector_size(VW)));

inline vf vload(const float* p) { vf x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline vf vload(const c10::BFloat16* p) {  // bf16 -> float: the 16 bits become the float's high half
  vh h;
  __builtin_memcpy(&h, p, sizeof h);
  const vu w = __builtin_convertvector(h, vu) << 16;
  vf x;
  __builtin_memcpy(&x, &w, sizeof x);
  return x;
}
inline void vstore(float* p, vf x) { __builtin_memcpy(p, &x, sizeof x); }
// x rounded to bfloat16 and back: nearest even, a NaN kept a (quiet) NaN, what vcvtneps2bf16 and
// c10::BFloat16(float) give (the rounding carry alone would take a NaN whose low mantissa bits are all set to -0 or
// an infinity); the bf16 value is the high half of each lane. Where the CPU has AVX512-BF16 that instruction does it
// in one step (it flushes denormals, below 1.2e-38, to zero: the attention kernel's and oneDNN's bf16 paths do too)
#if defined(__AVX512BF16__)
inline __m256i cvt_bf16(vf x) {
  __m512 m;
  __builtin_memcpy(&m, &x, sizeof m);
  return (__m256i)_mm512_cvtneps_pbh(m);
}
inline vf vround_bf16(vf x) {
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt_bf16(x)), 16);
  vf out;
  __builtin_memcpy(&out, &w, sizeof out);
  return out;
}
inline void vstore(c10::BFloat16* p, vf x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), cvt_bf16(x)); }
#else
inline vf vround_bf16(vf x) {
  vu w;
  __builtin_memcpy(&w, &x, sizeof w);
  const vu rounded = ((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16) << 16;
  const vu bits = x != x ? w | 0x400000u : rounded;
  vf out;
  __builtin_memcpy(&out, &bits, sizeof out);
  return out;
}
// float -> bf16, rounded as vround_bf16
inline void vstore(c10::BFloat16* p, vf x) {
  const vf r = vround_bf16(x);
  vu w;
  __builtin_memcpy(&w, &r, sizeof w);
  const vh h = __builtin_convertvector(w >> 16, vh);
  __builtin_memcpy(p, &h, sizeof h);
}
#endif
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf splat(float v) { return vf{} + v; }

// round half to even for |x| < 2^22 (adding 1.5 * 2^23 rounds in the default mode)
inline vf vround(vf x) { return (x + 12582912.f) - 12582912.f; }
inline float sround(float x) { return (x + 12582912.f) - 12582912.f; }

// e^x for x in [-87, 88] (no range checks): Cephes' expf, 2^n times a degree-6 polynomial of the remainder (~1 ulp)
inline vf vexp_core(vf x) {
  const vf n = vround(x * wde_exp::LOG2E);
  const vf p = wde_exp::exp_remainder(wde_exp::exp_reduce(x, n));
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// e^x lane by lane, any x: 0 below -87, clamped above 88
inline vf vexp(vf x) {
  const vf dead = x < -87.f ? splat(1.f) : vf{};
  const vf e = vexp_core(vmax(vmin(x, splat(88.f)), splat(-87.f)));
  return dead != 0.f ? vf{} : e;
}

// 1 / d: the hardware estimate and one Newton step (~1 ulp), instead of a division
inline vf vrcp(vf d) {
#if defined(__AVX512F__)
  __m512 m;
  __builtin_memcpy(&m, &d, sizeof m);
  m = _mm512_rcp14_ps(m);
  vf r;
  __builtin_memcpy(&r, &m, sizeof r);
#elif defined(__AVX__)
  __m256 h;
  __builtin_memcpy(&h, &d, sizeof h);
  h = _mm256_rcp_ps(h);
  vf r;
  __builtin_memcpy(&r, &h, sizeof r);
#else
  const vf r = 1.f / d;
#endif
  return r * (2.f - d * r);
}

// erf(x): Abramowitz & Stegun 7.1.28, 1 - 1 / (1 + a1 |x| + ... + a6 |x|^6)^16 (absolute error below 3e-7 in exact
// arithmetic, ~1e-6 in float), odd in x: a polynomial, four squarings and a reciprocal, no exp
inline vf verf(vf x) {
  const vf a = vmin(x < 0.f ? -x : x, splat(6.f));  // erf(6) is 1 in float; the power stays finite
  vf p = splat(4.30638e-5f);
  p = p * a + 2.765672e-4f;
  p = p * a + 1.520143e-4f;
  p = p * a + 9.2705272e-3f;
  p = p * a + 4.22820123e-2f;
  p = p * a + 7.05230784e-2f;
  p = p * a + 1.f;
  p = p * p;  // ^2
  p = p * p;  // ^4
  p = p * p;  // ^8
  p = p * p;  // ^16
  const vf e = 1.f - vrcp(p);
  return x < 0.f ? -e : e;
}

enum Act : int64_t { NONE = 0, GELU = 1, GELU_TANH = 2, RELU = 3 };

inline vf activate(vf y, int64_t act) {
  switch (act) {
    case GELU: return 0.5f * y * (1.f + verf(y * 0.70710678118654752f));
    case GELU_TANH: {  // 0.5 y (1 + tanh(u)), tanh(u) = 1 - 2 / (e^{2u} + 1)
      const vf u = 0.7978845608028654f * (y + 0.044715f * y * y * y);
      return 0.5f * y * (2.f - 2.f * vrcp(vexp(2.f * u) + 1.f));
    }
    case RELU: return vmax(y, vf{});
    default: return y;
  }
}

// one row of quantize_rows: xr [k] (times f, when given) to u8 qr with its scale and zero point
template <typename T>
inline void quantize_row(const T* xr, const float* f, int64_t k, uint8_t* qr, float* scale, float* zero) {
  vf lo = splat(INFINITY), hi = splat(-INFINITY), bad = {};
  float slo = INFINITY, shi = -INFINITY, sbad = 0.f;
  int64_t c = 0;
  for (; c + VW <= k; c += VW) {
    vf v = vload(xr + c);
    if (f) v *= vload(f + c);
    lo = vmin(lo, v);
    hi = vmax(hi, v);
    bad += v - v;  // 0, or NaN from a NaN or an infinity: min and max would drop a NaN
  }
  for (; c < k; ++c) {
    const float v = static_cast<float>(xr[c]) * (f ? f[c] : 1.f);
    slo = std::min(slo, v);
    shi = std::max(shi, v);
    sbad += v - v;
  }
  for (int64_t i = 0; i < VW; ++i) {
    slo = std::min(slo, lo[i]);
    shi = std::max(shi, hi[i]);
    sbad += bad[i];
  }
  // the range always holds 0, so 0 is exact (zero point an integer in 0..255); a row of zeros gets scale 1; a row
  // holding a NaN or an infinity gets scale NaN (its u8 values 0), so the layer's output row is NaN, not finite
  slo = std::min(slo, 0.f);
  shi = std::max(shi, 0.f);
  const float s = sbad != 0.f ? NAN : shi > slo ? (shi - slo) / 255.f : 1.f;
  const float z = sbad != 0.f ? 0.f : std::min(255.f, std::max(0.f, sround(-slo / s)));
  const float inv = 1.f / s;
  *scale = s;
  *zero = z;
  c = 0;
#if defined(__AVX512F__)
  // the rounding conversion (round half to even, as vround) and a saturating narrowing: 5 instructions a vector
  const __m512i vz = _mm512_set1_epi32(static_cast<int32_t>(z));
  for (; c + VW <= k; c += VW) {
    vf v = vload(xr + c);
    if (f) v *= vload(f + c);
    v *= inv;
    __m512 m;
    __builtin_memcpy(&m, &v, sizeof m);
    const __m512i i = _mm512_max_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(m), vz), _mm512_setzero_si512());
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + c), _mm512_cvtusepi32_epi8(i));  // above 255: 255
  }
#elif defined(__AVX2__)
  // the same with AVX2: the rounding conversion, then two saturating packs (below 0: 0, above 255: 255)
  const __m256i vz = _mm256_set1_epi32(static_cast<int32_t>(z));
  for (; c + VW <= k; c += VW) {
    vf v = vload(xr + c);
    if (f) v *= vload(f + c);
    v *= inv;
    __m256 m;
    __builtin_memcpy(&m, &v, sizeof m);
    const __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(m), vz);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + c), _mm_packus_epi16(w, w));
  }
#else
  for (; c + VW <= k; c += VW) {
    vf v = vload(xr + c);
    if (f) v *= vload(f + c);
    v = vmin(vmax(vround(v * inv) + z, vf{}), splat(255.f));
    const vb bytes = __builtin_convertvector(__builtin_convertvector(v, vi), vb);  // 0..255: exact
    __builtin_memcpy(qr + c, &bytes, sizeof bytes);
  }
#endif
  for (; c < k; ++c) {
    const float v = static_cast<float>(xr[c]) * (f ? f[c] : 1.f);
    qr[c] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, sround(v * inv) + z)));
  }
}

template <typename T>
void quantize_impl(const T* x, const float* f, int64_t rows, int64_t k, uint8_t* q, float* scale, float* zero) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * k, f, k, q + r * k, scale + r, zero + r);
  });
}

// a * b + c with one rounding, written out: GCC contracts a * b + c into an FMA or not depending on the code around
// it, so passes that must agree bit for bit take their FMAs from here
inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  __m512 x, y, w;
  __builtin_memcpy(&x, &a, sizeof x);
  __builtin_memcpy(&y, &b, sizeof y);
  __builtin_memcpy(&w, &c, sizeof w);
  const __m512 r = _mm512_fmadd_ps(x, y, w);
  vf out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
#elif defined(__FMA__)
  __m256 x, y, w;
  __builtin_memcpy(&x, &a, sizeof x);
  __builtin_memcpy(&y, &b, sizeof y);
  __builtin_memcpy(&w, &c, sizeof w);
  const __m256 r = _mm256_fmadd_ps(x, y, w);
  vf out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
#else
  return a * b + c;  // no FMA instructions: nothing to contract into
#endif
}

// VW values of dequantize_rows_'s row, from column c: act(s * (yr - z * cs) + b); and one value. The one place
// this arithmetic is written, so the fused passes round as dequantize_rows_ does
template <int64_t ACT>
inline vf dequantize_vec(const float* yr, float s, float z, const float* cs, const float* b, int64_t c) {
  const vf t = vfma(splat(-z), vload(cs + c), vload(yr + c));
  return activate(b ? vfma(splat(s), t, vload(b + c)) : s * t, ACT);
}

template <int64_t ACT>
inline float dequantize1(const float* yr, float s, float z, const float* cs, const float* b, int64_t c) {
  const vf t = vfma(splat(-z), splat(cs[c]), splat(yr[c]));
  return activate(b ? vfma(splat(s), t, splat(b[c])) : s * t, ACT)[0];
}

// one row of dequantize_rows_: out [m] = act(s * (yr - z * cs) + b), in place (out = yr) or to bf16
template <int64_t ACT, typename T>
inline void dequantize_row(const float* yr, float s, float z, const float* cs, const float* b, int64_t m, T* out) {
  int64_t c = 0;
  for (; c + VW <= m; c += VW) vstore(out + c, dequantize_vec<ACT>(yr, s, z, cs, b, c));
  for (; c < m; ++c) {
    const float v = dequantize1<ACT>(yr, s, z, cs, b, c);
    if constexpr (std::is_same_v<T, float>) {
      out[c] = v;
    } else {  // bytes, so no type-based aliasing lets the compiler move it past reads of y's floats it overwrites
      const c10::BFloat16 b16(v);
      __builtin_memcpy(out + c, &b16, sizeof b16);
    }
  }
}

// out's rows `stride` elements apart: m for float32 in place, 2m for bf16 written over the first half of each float32
// row (a vector's 2 VW bytes land on floats the loop has read: c / 2 + VW / 2 <= c + VW)
template <int64_t ACT, typename T>
void dequantize_impl(const float* yp, const float* sp, const float* zp, const float* cs, const float* b, int64_t rows,
                     int64_t m, T* out, int64_t stride) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequantize_row<ACT>(yp + r * m, sp[r], zp[r], cs, b, m, out + r * stride);
  });
}

// dequantize_impl, then each row quantized for the next layer (times f) while it is still in L1: what
// quantize_impl would give on the dequantized output, without reading it back from memory (the row's range taken in
// the dequantizing loop instead of a loop of its own measured slower: 1.77 against 1.65 ms on 2048 x 3072, Zen 5)
template <int64_t ACT>
void dequantize_quantize_impl(float* yp, const float* sp, const float* zp, const float* cs, const float* b,
                              int64_t rows, int64_t m, const float* f, uint8_t* q, float* scale, float* zero) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      dequantize_row<ACT>(yp + r * m, sp[r], zp[r], cs, b, m, yp + r * m);
      quantize_row(static_cast<const float*>(yp + r * m), f, m, q + r * m, scale + r, zero + r);
    }
  });
}

// LayerNorm of the row o [n] in place, given the sum of its values (acc, lanes, plus tail): the mean, then the
// variance from a second pass over the row while it sits in L1, then the scale and shift
inline void layer_norm_row(float* o, int64_t n, vf acc, float tail, const float* w, const float* b, float eps) {
  float sum = tail;
  for (int64_t i = 0; i < VW; ++i) sum += acc[i];
  const float mean = sum / static_cast<float>(n);
  vf sq = {};
  float sqt = 0.f;
  int64_t c = 0;
  for (; c + VW <= n; c += VW) {
    const vf d = vload(o + c) - mean;
    sq += d * d;
  }
  for (; c < n; ++c) sqt += (o[c] - mean) * (o[c] - mean);
  for (int64_t i = 0; i < VW; ++i) sqt += sq[i];
  const float rstd = 1.f / std::sqrt(sqt / static_cast<float>(n) + eps);
  for (c = 0; c + VW <= n; c += VW) {
    vf v = (vload(o + c) - mean) * rstd;
    if (w) v *= vload(w + c);
    if (b) v += vload(b + c);
    vstore(o + c, v);
  }
  for (; c < n; ++c) {
    float v = (o[c] - mean) * rstd;
    if (w) v *= w[c];
    if (b) v += b[c];
    o[c] = v;
  }
}

template <typename T>
void add_layer_norm_impl(const T* x, const float* res, const float* w, const float* b, float eps, int64_t rows,
                         int64_t n, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      const float* rr = res + r * n;
      float* o = out + r * n;
      vf acc = {};
      float tail = 0.f;
      int64_t c = 0;
      for (; c + VW <= n; c += VW) {
        const vf h = vload(xr + c) + vload(rr + c);
        vstore(o + c, h);
        acc += h;
      }
      for (; c < n; ++c) {
        o[c] = static_cast<float>(xr[c]) + rr[c];
        tail += o[c];
      }
      layer_norm_row(o, n, acc, tail, w, b, eps);
    }
  });
}

// dequantize_impl (no activation) and add_layer_norm_impl in one pass over y, in place: each row of the int8 GEMM's
// output is dequantized and the residual added as the norm's first pass reads it; with q given, each normed row is
// then quantized for the int8 layer that takes the norm's output (times f), while it is still in L1
void dequantize_add_layer_norm_impl(float* yp, const float* sp, const float* zp, const float* cs, const float* bias,
                                    const float* res, const float* w, const float* b, float eps, int64_t rows,
                                    int64_t n, const float* f = nullptr, uint8_t* q = nullptr,
                                    float* qscale = nullptr, float* qzero = nullptr) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* o = yp + r * n;
      const float* rr = res + r * n;
      const float s = sp[r], z = zp[r];
      vf acc = {};
      float tail = 0.f;
      int64_t c = 0;
      for (; c + VW <= n; c += VW) {
        const vf h = dequantize_vec<NONE>(o, s, z, cs, bias, c) + vload(rr + c);
        vstore(o + c, h);
        acc += h;
      }
      for (; c < n; ++c) {
        o[c] = dequantize1<NONE>(o, s, z, cs, bias, c) + rr[c];
        tail += o[c];
      }
      layer_norm_row(o, n, acc, tail, w, b, eps);
      if (q) quantize_row(static_cast<const float*>(o), f, n, q + r * n, qscale + r, qzero + r);
    }
  });
}

}  // namespace

// a LayerNorm's weight and bias [n] (float32 or None), checked
std::pair<const float*, const float*> norm_params(const c10::optional<at::Tensor>& weight,
                                                 const c10::optional<at::Tensor>& bias, int64_t n) {
  for (const auto* t : {&weight, &bias}) {
    if (t->has_value()) {
      TORCH_CHECK((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() && (*t)->numel() == n,
                  "cpu_ops: weight and bias must be contiguous float32 [n]");
    }
  }
  return {weight.has_value() ? weight->data_ptr<float>() : nullptr,
          bias.has_value() ? bias->data_ptr<float>() : nullptr};
}

// f(a value of t's C++ type), t float32 or bfloat16 (checked by the caller with low_or_float)
template <typename F>
void with_type(at::ScalarType t, F&& f) {
  if (t == at::kFloat) f(float{}); else f(c10::BFloat16{});
}

bool low_or_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// LayerNorm(x + residual) over the last dim: x [rows, n] float32 / bfloat16, residual [rows, n] float32 (both
// contiguous), weight / bias [n] float32 or None. Returns a new float32 [rows, n] tensor.
at::Tensor add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const c10::optional<at::Tensor>& weight,
                          const c10::optional<at::Tensor>& bias, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
              residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat,
              "cpu_ops: x and a float32 residual of one shape, contiguous 2-d CPU tensors");
  const int64_t rows = x.size(0), n = x.size(1);
  const auto [w, b] = norm_params(weight, bias, n);
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  TORCH_CHECK(low_or_float(x.scalar_type()), "cpu_ops: x must be float32 or bfloat16, got ", x.scalar_type());
  with_type(x.scalar_type(), [&](auto xv) {
    add_layer_norm_impl(x.data_ptr<decltype(xv)>(), residual.data_ptr<float>(), w, b, static_cast<float>(eps), rows,
                        n, out.data_ptr<float>());
  });
  return out;
}

// SmoothQuant's per-channel factor [k] (float32, contiguous) or None, checked
const float* factor_arg(const c10::optional<at::Tensor>& factor, int64_t k) {
  if (!factor.has_value()) return nullptr;
  TORCH_CHECK(factor->scalar_type() == at::kFloat && factor->is_contiguous() && factor->numel() == k,
              "cpu_ops: factor must be a contiguous float32 [", k, "]");
  return factor->data_ptr<float>();
}

// u8 [padded, k], the rows past `rows` zero. The caller rounds `padded` up from rows (wde's cpu_linear.padded_rows,
// the one place the rule lives): oneDNN's int8 GEMM builds a primitive per distinct row count, rounded counts repeat
at::Tensor padded_bytes(int64_t rows, int64_t k, int64_t padded, const at::TensorOptions& options) {
  TORCH_CHECK(padded >= rows, "cpu_ops: padded (", padded, ") must be >= rows (", rows, ")");
  at::Tensor q = at::empty({padded, k}, options.dtype(at::kByte));
  if (padded > rows) std::memset(q.data_ptr<uint8_t>() + rows * k, 0, (padded - rows) * k);
  return q;
}

// x [rows, k] float32 / bfloat16, contiguous; factor [k] float32 or None. Returns (q u8 [rows', k], scale [rows],
// zero [rows]) with x * factor ~= scale * (q - zero) row by row; rows' is `padded` (>= rows; zero rows past rows).
std::vector<at::Tensor> quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& factor, int64_t padded) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "cpu_ops: x must be a contiguous 2-d CPU tensor");
  const int64_t rows = x.size(0), k = x.size(1);
  const float* f = factor_arg(factor, k);
  at::Tensor q = padded_bytes(rows, k, padded, x.options());
  at::Tensor scale = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor zero = at::empty({rows}, x.options().dtype(at::kFloat));
  TORCH_CHECK(low_or_float(x.scalar_type()), "cpu_ops: float32 or bfloat16 input only, got ", x.scalar_type());
  with_type(x.scalar_type(), [&](auto xv) {
    quantize_impl(x.data_ptr<decltype(xv)>(), f, rows, k, q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                  zero.data_ptr<float>());
  });
  return {q, scale, zero};
}

// the arguments of dequantize_rows_ and dequantize_quantize_rows_, checked
struct Dequant {
  float* y;
  const float *scale, *zero, *colsum, *bias;
  int64_t rows, m;
};

Dequant dequant_args(at::Tensor& y, const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& colsum,
                     const c10::optional<at::Tensor>& bias, int64_t act) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "cpu_ops: y must be a contiguous float32 2-d CPU tensor");
  const int64_t rows = y.size(0), m = y.size(1);
  TORCH_CHECK(scale.numel() == rows && zero.numel() == rows && colsum.numel() == m, "cpu_ops: size mismatch");
  TORCH_CHECK(act >= NONE && act <= RELU, "cpu_ops: unknown activation ", act);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == m,
                "cpu_ops: bias must be a contiguous float32 [m]");
    b = bias->data_ptr<float>();
  }
  return {y.data_ptr<float>(), scale.data_ptr<float>(), zero.data_ptr<float>(), colsum.data_ptr<float>(), b, rows, m};
}

// f(std::integral_constant<int64_t, act>{}): kernels specialized for the activation
template <typename F>
void with_activation(int64_t act, F&& f) {
  switch (act) {
    case GELU: return f(std::integral_constant<int64_t, GELU>{});
    case GELU_TANH: return f(std::integral_constant<int64_t, GELU_TANH>{});
    case RELU: return f(std::integral_constant<int64_t, RELU>{});
    default: return f(std::integral_constant<int64_t, NONE>{});
  }
}

// In place on y [rows, m] float32 contiguous: y = scale[r] * (y - zero[r] * colsum) + bias, then act
// (0 none, 1 erf GELU, 2 tanh GELU, 3 ReLU). Returns y.
at::Tensor dequantize_rows_(at::Tensor& y, const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& colsum,
                            const c10::optional<at::Tensor>& bias, int64_t act) {
  const Dequant d = dequant_args(y, scale, zero, colsum, bias, act);
  with_activation(act, [&](auto a) {
    dequantize_impl<a()>(d.y, d.scale, d.zero, d.colsum, d.bias, d.rows, d.m, d.y, d.m);
  });
  return y;
}

// dequantize_rows_, rounded to bfloat16 (to nearest even) and written in place over the first half of each row of
// y: returns the bf16 [rows, m] view (rows 2m apart) of y's storage, y's float32 values spent. For an int8 layer
// whose output an attention with bf16 products reads, which would round it so as it reads it. (Into a new tensor
// instead, the write to memory not yet in cache measured slower than the float32 pass in place.)
at::Tensor dequantize_rows_bf16_(at::Tensor& y, const at::Tensor& scale, const at::Tensor& zero,
                                 const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, int64_t act) {
  const Dequant d = dequant_args(y, scale, zero, colsum, bias, act);
  auto* out = reinterpret_cast<c10::BFloat16*>(d.y);
  with_activation(act, [&](auto a) {
    dequantize_impl<a()>(d.y, d.scale, d.zero, d.colsum, d.bias, d.rows, d.m, out, 2 * d.m);
  });
  return y.view(at::kBFloat16).narrow(1, 0, d.m);
}

// dequantize_rows_ on y, then y's rows quantized as quantize_rows(y, factor, padded) would: returns (q u8 [rows',
// m], scale [rows], zero [rows]) for the next int8 layer, with y (dequantized, activated) in place as
// dequantize_rows_ leaves it
std::vector<at::Tensor> dequantize_quantize_rows_(at::Tensor& y, const at::Tensor& scale, const at::Tensor& zero,
                                                  const at::Tensor& colsum, const c10::optional<at::Tensor>& bias,
                                                  int64_t act, const c10::optional<at::Tensor>& factor,
                                                  int64_t padded) {
  const Dequant d = dequant_args(y, scale, zero, colsum, bias, act);
  const float* f = factor_arg(factor, d.m);
  at::Tensor q = padded_bytes(d.rows, d.m, padded, y.options());
  at::Tensor s2 = at::empty({d.rows}, y.options());
  at::Tensor z2 = at::empty({d.rows}, y.options());
  with_activation(act, [&](auto a) {
    dequantize_quantize_impl<a()>(d.y, d.scale, d.zero, d.colsum, d.bias, d.rows, d.m, f, q.data_ptr<uint8_t>(),
                                  s2.data_ptr<float>(), z2.data_ptr<float>());
  });
  return {q, s2, z2};
}

// the checked arguments of dequantize_add_layer_norm_ and dequantize_add_layer_norm_quantize_
struct DequantNorm {
  Dequant d;
  const float *residual, *w, *b;
};

DequantNorm dequant_norm_args(at::Tensor& y, const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& colsum,
                              const c10::optional<at::Tensor>& bias, const at::Tensor& residual,
                              const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& norm_bias) {
  const Dequant d = dequant_args(y, scale, zero, colsum, bias, NONE);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == y.sizes() && residual.scalar_type() == at::kFloat,
              "cpu_ops: the residual must be a contiguous float32 tensor of y's shape");
  const auto [w, b] = norm_params(weight, norm_bias, d.m);
  return {d, residual.data_ptr<float>(), w, b};
}

// dequantize_rows_ (no activation) on y [rows, n], then LayerNorm(y + residual) in place, in one pass: y becomes
// what add_layer_norm(dequantize_rows_(y, ...), residual, weight, norm_bias, eps) returns. Returns y.
at::Tensor dequantize_add_layer_norm_(at::Tensor& y, const at::Tensor& scale, const at::Tensor& zero,
                                      const at::Tensor& colsum, const c10::optional<at::Tensor>& bias,
                                      const at::Tensor& residual, const c10::optional<at::Tensor>& weight,
                                      const c10::optional<at::Tensor>& norm_bias, double eps) {
  const DequantNorm a = dequant_norm_args(y, scale, zero, colsum, bias, residual, weight, norm_bias);
  dequantize_add_layer_norm_impl(a.d.y, a.d.scale, a.d.zero, a.d.colsum, a.d.bias, a.residual, a.w, a.b,
                                 static_cast<float>(eps), a.d.rows, a.d.m);
  return y;
}

// dequantize_add_layer_norm_ on y, then y's rows quantized as quantize_rows(y, factor, padded) would, for the
// int8 layer that takes the norm's output: returns (q u8 [rows', n], scale [rows], zero [rows]), y normed in place
std::vector<at::Tensor> dequantize_add_layer_norm_quantize_(
    at::Tensor& y, const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& colsum,
    const c10::optional<at::Tensor>& bias, const at::Tensor& residual, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& norm_bias, double eps, const c10::optional<at::Tensor>& factor,
    int64_t padded) {
  const DequantNorm a = dequant_norm_args(y, scale, zero, colsum, bias, residual, weight, norm_bias);
  const float* f = factor_arg(factor, a.d.m);
  at::Tensor q = padded_bytes(a.d.rows, a.d.m, padded, y.options());
  at::Tensor s2 = at::empty({a.d.rows}, y.options());
  at::Tensor z2 = at::empty({a.d.rows}, y.options());
  dequantize_add_layer_norm_impl(a.d.y, a.d.scale, a.d.zero, a.d.colsum, a.d.bias, a.residual, a.w, a.b,
                                 static_cast<float>(eps), a.d.rows, a.d.m, f, q.data_ptr<uint8_t>(),
                                 s2.data_ptr<float>(), z2.data_ptr<float>());
  return {q, s2, z2};
}

// ---- pre-norm decoders: add + RMSNorm, SiLU * up ----

// x rounded to T and back: what storing a float result in a T tensor does
template <typename T> inline vf as_dtype(vf x) {
  if constexpr (std::is_same_v<T, float>) return x; else return vround_bf16(x);
}
template <typename T> inline float as_dtype1(float x) { return static_cast<float>(static_cast<T>(x)); }

// 1 / sqrt(mean square + eps) of a row of n from its sums of squares: VW lanes and a scalar tail
inline float rsqrt_mean(vf sq, float tail, int64_t n, float eps) {
  for (int64_t i = 0; i < VW; ++i) tail += sq[i];
  return 1.f / std::sqrt(tail / static_cast<float>(n) + eps);
}
template <typename T> inline float row_rsqrt(const T* x, int64_t n, float eps) {
  vf sq = {};
  float tail = 0.f;
  int64_t c = 0;
  for (; c + VW <= n; c += VW) {
    const vf v = vload(x + c);
    sq += v * v;
  }
  for (; c < n; ++c) tail += static_cast<float>(x[c]) * static_cast<float>(x[c]);
  return rsqrt_mean(sq, tail, n, eps);
}

// one row: h = H(x + r) (written to hr where r is given), y = H(h * rsqrt(mean(h^2) + eps)), out = O(w * y). H is x's
// dtype or, for a float32 residual (mixed precision), float32; O the promoted dtype or a lower one the caller asked for
// (the linear layer that takes the output casts to it: one rounding either way)
template <typename X, typename H, typename W, typename O>
inline void rms_row(const X* xr, const H* rr, const W* w, float eps, int64_t n, O* out, H* hr, bool round) {
  vf sq = {};
  float sqt = 0.f;
  int64_t c = 0;
  for (; c + VW <= n; c += VW) {
    vf h = vload(xr + c);
    if (rr) {
      h = as_dtype<H>(h + vload(rr + c));
      vstore(hr + c, h);
    }
    sq += h * h;
  }
  for (; c < n; ++c) {
    float h = static_cast<float>(xr[c]);
    if (rr) {
      h = as_dtype1<H>(h + static_cast<float>(rr[c]));
      hr[c] = static_cast<H>(h);
    }
    sqt += h * h;
  }
  const float r = rsqrt_mean(sq, sqt, n, eps);
  auto second = [&](const auto* src) {
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
      const vf v = vload(src + j) * r;
      vstore(out + j, as_dtype<O>((round ? as_dtype<H>(v) : v) * vload(w + j)));
    }
    for (; j < n; ++j) {
      const float v = static_cast<float>(src[j]) * r;
      out[j] = static_cast<O>((round ? as_dtype1<H>(v) : v) * static_cast<float>(w[j]));
    }
  };
  if (rr) second(hr); else second(xr);
}

template <typename X, typename H, typename W, typename O>
void add_rms_norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                       float eps, at::Tensor& out, c10::optional<at::Tensor>& h, bool round) {
  const int64_t a = x.size(0), b = x.size(1), n = x.size(2);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  const X* xp = x.data_ptr<X>();
  const H* rp = residual ? residual->data_ptr<H>() : nullptr;
  const int64_t rs0 = residual ? residual->stride(0) : 0, rs1 = residual ? residual->stride(1) : 0;
  H* hp = h ? h->data_ptr<H>() : nullptr;
  const W* wp = weight.data_ptr<W>();
  O* op = out.data_ptr<O>();
  at::parallel_for(0, a * b, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t ia = i / b, ib = i % b;
      rms_row<X, H, W, O>(xp + ia * xs0 + ib * xs1, rp ? rp + ia * rs0 + ib * rs1 : nullptr, wp, eps, n,
                          op + i * n, hp ? hp + i * n : nullptr, round);
    }
  });
}

// an output of `rows` rows of n values of dtype t, in storage for max(rows, capacity) rows (a oneDNN linear layer
// taking it pads its rows to `capacity` in place: wde/components/models/cpu_linear.py)
at::Tensor rows_tensor(at::IntArrayRef sizes, int64_t rows, int64_t n, int64_t capacity, const at::TensorOptions& o) {
  if (capacity <= rows) return at::empty(sizes, o);
  return at::empty({capacity * n}, o).narrow(0, 0, rows * n).view(sizes);
}

// out_dtype (none: the promoted dtype) checked: the promoted dtype, or bfloat16 below a float32 one
at::ScalarType out_type(const c10::optional<at::ScalarType>& out_dtype, at::ScalarType promoted) {
  if (!out_dtype) return promoted;
  const auto o = *out_dtype;
  TORCH_CHECK(o == promoted || o == at::kBFloat16, "cpu_ops: the output dtype must be the promoted dtype or bfloat16");
  return o;
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& weight, double eps,
                                     const c10::optional<at::ScalarType>& out_dtype, int64_t capacity,
                                     bool round_normed) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "cpu_ops: x must be a CPU [A, B, n] tensor"
              " whose last dimension is contiguous");
  const auto t = x.scalar_type(), wt = weight.scalar_type();
  TORCH_CHECK(low_or_float(t), "cpu_ops: x must be float32 or bfloat16");
  TORCH_CHECK(low_or_float(wt) && weight.is_contiguous() && weight.numel() == x.size(2),
              "cpu_ops: the weight must be a contiguous float32 or bfloat16 [n]");
  auto ht = t;
  if (residual) {
    ht = residual->scalar_type();
    TORCH_CHECK((ht == t || ht == at::kFloat) && residual->sizes() == x.sizes() && residual->stride(2) == 1,
                "cpu_ops: the residual must have x's shape and x's dtype or float32");
  }
  const auto ot = out_type(out_dtype, (ht == at::kBFloat16 && wt == at::kBFloat16) ? at::kBFloat16 : at::kFloat);
  const int64_t rows = x.size(0) * x.size(1), n = x.size(2);
  at::Tensor out = rows_tensor(x.sizes(), rows, n, capacity, x.options().dtype(ot));
  c10::optional<at::Tensor> h;
  if (residual) h = at::empty(x.sizes(), x.options().dtype(ht));
  const float e = static_cast<float>(eps);
  with_type(t, [&](auto xv) {
    with_type(ht, [&](auto hv) {
      with_type(wt, [&](auto wv) {
        with_type(ot, [&](auto ov) {
          using X = decltype(xv);
          using H = decltype(hv);
          if constexpr (std::is_same_v<X, H> || std::is_same_v<H, float>) {
            add_rms_norm_impl<X, H, decltype(wv), decltype(ov)>(x, residual, weight, e, out, h, round_normed);
          }
        });
      });
    });
  });
  if (h) return {out, *h};
  return {out};
}

// Gemma's sandwich: h = H(residual + X(x * r1 * w1)), out = O(h * r2 * w2), r the rows' rsqrt(mean(square) + eps):
// a block's output norm, the residual add and the next norm (Gemma's RMSNorms: float32, no rounding before the
// scale, w = 1 + weight given as float32) in three passes over a row while it sits in L1
template <typename X, typename H, typename O>
void norm_add_norm_impl(const X* xp, const H* rp, const float* w1, const float* w2, float eps1, float eps2,
                        int64_t rows, int64_t n, O* op, H* hp) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const X* xr = xp + i * n;
      const H* rr = rp + i * n;
      H* hr = hp + i * n;
      O* o = op + i * n;
      const float r1 = row_rsqrt(xr, n, eps1);
      vf sq = {};
      float sqt = 0.f;
      int64_t c = 0;
      for (; c + VW <= n; c += VW) {
        const vf h = as_dtype<H>(vload(rr + c) + as_dtype<X>(vload(xr + c) * r1 * vload(w1 + c)));
        vstore(hr + c, h);
        sq += h * h;
      }
      for (; c < n; ++c) {
        const float h = as_dtype1<H>(static_cast<float>(rr[c]) + as_dtype1<X>(static_cast<float>(xr[c]) * r1 * w1[c]));
        hr[c] = static_cast<H>(h);
        sqt += h * h;
      }
      const float r2 = rsqrt_mean(sq, sqt, n, eps2);
      for (c = 0; c + VW <= n; c += VW) vstore(o + c, as_dtype<O>(vload(hr + c) * r2 * vload(w2 + c)));
      for (; c < n; ++c) o[c] = static_cast<O>(static_cast<float>(hr[c]) * r2 * w2[c]);
    }
  });
}

std::vector<at::Tensor> norm_add_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w1,
                                      const at::Tensor& w2, double eps1, double eps2,
                                      const c10::optional<at::ScalarType>& out_dtype, int64_t capacity) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes()
              && residual.is_contiguous(), "cpu_ops: x and the residual must be contiguous CPU [rows, n] tensors");
  const auto t = x.scalar_type(), ht = residual.scalar_type();
  TORCH_CHECK(low_or_float(t) && (ht == t || ht == at::kFloat), "cpu_ops: x must be float32 or bfloat16, the"
              " residual of x's dtype or float32");
  const int64_t rows = x.size(0), n = x.size(1);
  for (const at::Tensor* w : {&w1, &w2})
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == n,
                "cpu_ops: the scales must be contiguous float32 [n]");
  const auto ot = out_type(out_dtype, ht);
  at::Tensor out = rows_tensor(x.sizes(), rows, n, capacity, x.options().dtype(ot));
  at::Tensor h = at::empty(x.sizes(), x.options().dtype(ht));
  with_type(t, [&](auto xv) {
    with_type(ht, [&](auto hv) {
      with_type(ot, [&](auto ov) {
        using X = decltype(xv);
        using H = decltype(hv);
        if constexpr (std::is_same_v<X, H> || std::is_same_v<H, float>) {
          norm_add_norm_impl<X, H, decltype(ov)>(x.data_ptr<X>(), residual.data_ptr<H>(), w1.data_ptr<float>(),
                                                 w2.data_ptr<float>(), static_cast<float>(eps1),
                                                 static_cast<float>(eps2), rows, n, out.data_ptr<decltype(ov)>(),
                                                 h.data_ptr<H>());
        }
      });
    });
  });
  return {out, h};
}

// Qwen3's per-head q/k RMSNorm (when a weight is given) and the half-split rotary embedding, then the cast to the
// attention's dtype, in one pass over each head's row, as the modules compute them one after the other:
//   y = P(w * X(x * rsqrt(mean(x^2) + eps)))        P = promote(X, W)   (y = x without a weight)
//   o = O(R(R(y * cos) + R(rotate_half(y) * sin)))   R = promote(P, C), O the attention's dtype
template <typename X, typename W, typename C, typename R, typename O>
void norm_rotary_impl(const at::Tensor& x, const W* wp, float eps, const C* cp, const C* sp, int64_t cs,
                      at::Tensor& out) {
  using P = std::conditional_t<std::is_same_v<X, float> || std::is_same_v<W, float>, float, c10::BFloat16>;
  const int64_t t = x.size(0), nh = x.size(1), d = x.size(2), half = d / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const X* xp = x.data_ptr<X>();
  O* op = out.data_ptr<O>();
  at::parallel_for(0, t * nh, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(wp ? d : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t it = i / nh, ih = i % nh;
      const X* xr = xp + it * s0 + ih * s1;
      const C* c = cp + it * cs;
      const C* sn = sp + it * cs;
      O* o = op + i * d;
      // y: the normed row (float32 values of P) or x itself; o = O(R(R(y * cos) + R(rotate_half(y) * sin)))
      auto rotate = [&](const auto* y) {
        int64_t j = 0;
        if (half % VW == 0) {
          for (; j < half; j += VW) {
            const vf a = vload(y + j), b = vload(y + half + j);
            vstore(o + j, as_dtype<O>(as_dtype<R>(as_dtype<R>(a * vload(c + j)) + as_dtype<R>(-b * vload(sn + j)))));
            vstore(o + half + j, as_dtype<O>(as_dtype<R>(as_dtype<R>(b * vload(c + half + j)) +
                                                         as_dtype<R>(a * vload(sn + half + j)))));
          }
        }
        for (; j < half; ++j) {
          const float a = static_cast<float>(y[j]), b = static_cast<float>(y[half + j]);
          o[j] = static_cast<O>(as_dtype1<R>(as_dtype1<R>(a * static_cast<float>(c[j])) +
                                             as_dtype1<R>(-b * static_cast<float>(sn[j]))));
          o[half + j] = static_cast<O>(as_dtype1<R>(as_dtype1<R>(b * static_cast<float>(c[half + j])) +
                                                    as_dtype1<R>(a * static_cast<float>(sn[half + j]))));
        }
      };
      if (!wp) {
        rotate(xr);
        continue;
      }
      const float r = row_rsqrt(xr, d, eps);
      int64_t j = 0;
      for (; j + VW <= d; j += VW)
        vstore(normed.data() + j, as_dtype<P>(as_dtype<X>(vload(xr + j) * r) * vload(wp + j)));
      for (; j < d; ++j)
        normed[j] = as_dtype1<P>(as_dtype1<X>(static_cast<float>(xr[j]) * r) * static_cast<float>(wp[j]));
      rotate(normed.data());
    }
  });
}

at::Tensor norm_rotary(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, const c10::optional<at::ScalarType>& out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "cpu_ops: x must be a CPU [T, H, d] tensor, d even, its last dimension contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.size(0) == x.size(0)
              && cos.size(1) == x.size(2) && cos.stride(1) == 1 && cos.scalar_type() == sin.scalar_type(),
              "cpu_ops: cos and sin must be [T, d] like x, of one dtype");
  const auto t = x.scalar_type(), ct = cos.scalar_type();
  TORCH_CHECK(low_or_float(t) && low_or_float(ct), "cpu_ops: x, cos and sin must be float32 or bfloat16");
  const auto wt = weight ? weight->scalar_type() : t;
  if (weight) {
    TORCH_CHECK(low_or_float(wt) && weight->is_contiguous() && weight->numel() == x.size(2),
                "cpu_ops: the weight must be a contiguous float32 or bfloat16 [d]");
  }
  const bool low = t == at::kBFloat16 && wt == at::kBFloat16 && ct == at::kBFloat16;
  const auto ot = out_type(out_dtype, low ? at::kBFloat16 : at::kFloat);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(ot));
  const float e = static_cast<float>(eps);
  with_type(t, [&](auto xv) {
    with_type(wt, [&](auto wv) {
      with_type(ct, [&](auto cv) {
        with_type(ot, [&](auto ov) {
          using X = decltype(xv);
          using W = decltype(wv);
          using C = decltype(cv);
          using R = std::conditional_t<std::is_same_v<X, float> || std::is_same_v<W, float> ||
                                       std::is_same_v<C, float>, float, c10::BFloat16>;
          const W* wp = weight ? weight->data_ptr<W>() : nullptr;
          norm_rotary_impl<X, W, C, R, decltype(ov)>(x, wp, e, cos.data_ptr<C>(), sin.data_ptr<C>(), cos.stride(0),
                                                      out);
        });
      });
    });
  });
  return out;
}

// act(g) rounded to T, times u, rounded to T; act SiLU, g / (1 + e^-g), or the tanh GELU written the same way,
// 0.5 g (1 + tanh(u)) = g / (1 + e^-2u) (no cancellation where tanh(u) is near -1, unlike `activate`'s form)
constexpr int64_t SILU = 0;  // silu_mul's act codes: SiLU, or GELU_TANH
inline vf gate_act(vf x, int64_t act) {
  const vf z = act == SILU ? x : 1.5957691216057308f * (x + 0.044715f * x * x * x);  // 2u
  return x * vrcp(1.f + vexp(-z));
}
inline float gate_act1(float x, int64_t act) {
  const float z = act == SILU ? x : 1.5957691216057308f * (x + 0.044715f * x * x * x);
  return x / (1.f + std::exp(-z));
}

template <typename T>
void silu_mul_impl(const T* gu, int64_t rows, int64_t m, int64_t stride, T* out, int64_t act) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * stride;
      const T* u = g + m;
      T* o = out + r * m;
      int64_t c = 0;
      for (; c + VW <= m; c += VW) {
        const vf s = as_dtype<T>(gate_act(vload(g + c), act));
        vstore(o + c, as_dtype<T>(s * vload(u + c)));
      }
      for (; c < m; ++c) {
        const float s = as_dtype1<T>(gate_act1(static_cast<float>(g[c]), act));
        o[c] = static_cast<T>(s * static_cast<float>(u[c]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t capacity, int64_t act) {
  TORCH_CHECK(act == SILU || act == GELU_TANH, "cpu_ops: act must be 0 (SiLU) or 2 (tanh GELU)");
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "cpu_ops: gate_up must be a CPU [rows, 2m] tensor whose rows are contiguous");
  TORCH_CHECK(low_or_float(gate_up.scalar_type()), "cpu_ops: gate_up must be float32 or bfloat16");
  const int64_t rows = gate_up.size(0), m = gate_up.size(1) / 2;
  at::Tensor out = rows_tensor({rows, m}, rows, m, capacity, gate_up.options());
  with_type(gate_up.scalar_type(), [&](auto v) {
    using T = decltype(v);
    silu_mul_impl(gate_up.data_ptr<T>(), rows, m, gate_up.stride(0), out.data_ptr<T>(), act);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_layer_norm", &add_layer_norm, "LayerNorm(x + residual), float32 out (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "RMSNorm(x + residual) * weight, and x + residual when given (CPU)",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("out_dtype") = pybind11::none(), pybind11::arg("capacity") = 0,
        pybind11::arg("round_normed") = true);
  m.def("norm_add_norm", &norm_add_norm, "Gemma's norm, the residual add and the next norm in one pass (CPU)",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("w1"), pybind11::arg("w2"),
        pybind11::arg("eps1"), pybind11::arg("eps2"), pybind11::arg("out_dtype") = pybind11::none(),
        pybind11::arg("capacity") = 0);
  m.def("norm_rotary", &norm_rotary, "per-head RMSNorm (optional), half-split rotary and a cast, in one pass (CPU)");
  m.def("silu_mul", &silu_mul, "act(gate) * up of a fused gate|up output, act SiLU (0) or tanh GELU (2) (CPU)",
        pybind11::arg("gate_up"), pybind11::arg("capacity") = 0, pybind11::arg("act") = 0);
  m.def("quantize_rows", &quantize_rows, "per-row asymmetric u8 quantization (CPU)");
  m.def("dequantize_rows_", &dequantize_rows_, "per-row dequantization, bias and activation, in place (CPU)");
  m.def("dequantize_rows_bf16_", &dequantize_rows_bf16_,
        "per-row dequantization, bias and activation, rounded to bfloat16 over y's own rows (CPU)");
  m.def("dequantize_quantize_rows_", &dequantize_quantize_rows_,
        "dequantize_rows_, then the rows quantized for the next int8 layer in the same pass (CPU)");
  m.def("dequantize_add_layer_norm_", &dequantize_add_layer_norm_,
        "dequantize_rows_, the residual added and LayerNorm, in one pass, in place (CPU)");
  m.def("dequantize_add_layer_norm_quantize_", &dequantize_add_layer_norm_quantize_,
        "dequantize_add_layer_norm_, then the normed rows quantized for the next int8 layer in the same pass (CPU)");
}
