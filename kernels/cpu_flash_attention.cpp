// Packed varlen attention on CPU: one call for a whole batch of sequences packed as [tokens, heads, head_dim].
//
// Work is split into tasks of (sequence, head, run of query blocks of QB rows). A task first converts the keys and
// values its rows can reach, once, into a thread-local buffer laid out for the inner loops (keys transposed into
// tiles of KB, values row by row, a key-mask bias per key), then walks its query blocks: each keeps its queries and
// a running output in local buffers and goes over the key tiles its rows reach with the online softmax (flash
// attention): no padding, no [len, len] score matrix, no gather. A sequence is cut into several runs of blocks only
// where that is needed to give every thread work (few sequences, many threads); tasks are taken longest first from
// a shared counter. A local window and the causal mask bound the key range of each row; a key mask (one bool per
// token) adds -inf to the scores of masked keys. A row left with no key to attend outputs zeros.
//
// Two inner paths. float32 inputs (and bf16 ones on CPUs without AVX512-BF16) are widened to float, and the dot
// products and softmax run in float with GCC vector types of one register (16 floats on AVX-512, 8 on AVX2), the scores
// of 4 query rows and the outputs of a few rows held in registers (as many as the width's registers hold without
// spilling), and a polynomial exp. bf16 inputs where the compiler targets AVX512-BF16
// (__AVX512BF16__) take Q.K^T and P.V with vdpbf16ps (bf16 pairs along the reduction, float accumulators): keys stay
// bf16 as pairs of dimensions (16 keys at a time through a 16 x 16 transpose), values are interleaved as pairs of keys,
// and the softmax weights P are rounded to bf16 as GPU flash kernels do. On that path the softmax runs on the scores
// while they are still in registers, 4 rows at a time: their maxima reduced together, the weights as 2^((s - max) scale
// log2 e) with a degree-4 polynomial (relative error 2.7e-6, far below the weights' bf16 rounding), written as bf16
// pairs for P.V; rows and keys are prefetched ahead of the blocks and conversions that read them. Where the build
// targets AMX (Sapphire Rapids and later) and Linux grants the tile state, that path's two products run as AMX tile
// products instead (tdpbf16ps on the same pair layouts; the softmax reads the scores back from an L1 buffer). head_dim
// is a template argument for 32, 64, 96, 128 and 256; a smaller head runs at the next of them, its rows read
// zero-padded (HEAD_SIZES). wde/kernels/cpp_build.py builds it for the host's own instruction set (-march=native), or
// for AVX2 under torch's AVX2 cap.
// Only the headers used (not torch/extension.h, whose parsing was most of a build's time: wde/kernels/cpp_build.py)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include "cpu_exp.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define WDE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t QB = 32;  // query rows per block
constexpr int64_t KB = 64;  // keys per tile
constexpr int64_t MAX_D = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Problem {
  const int64_t* cu;
  const bool* key_mask;  // nullptr: every key may be attended
  int64_t hq, hk, d;  // d: the head size; the template's D may be larger (the rest read as zeros)
  int64_t left, right;  // window; huge when there is none
  bool causal;
  float scale;
};

template <typename T>
struct Packed {  // a [tokens, heads, d] tensor with unit stride on d
  T* p;
  int64_t st, sh;
  T* row(int64_t token, int64_t head) const { return p + token * st + head * sh; }
};

struct Task {  // query blocks [b0, b1) of one sequence, for every query head that reads key/value head kvh
  int64_t seq, kvh, b0, b1, cost;
};

constexpr int64_t RG = 4;  // query rows whose scores are accumulated together in registers
#ifdef __AVX512F__
typedef float vf __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register (32 of them)
constexpr int64_t VW = 16;
constexpr int64_t NS = 4;  // vectors of keys whose scores RG rows accumulate together: 16 accumulators (a tile)
// query rows whose outputs are accumulated together: 16 accumulator registers (of 32), enough in flight to hide the
// FMA latency
template <int64_t D> constexpr int64_t RP = 256 / D;
template <int64_t D> constexpr int64_t XC = D / VW;  // vectors of each row's output accumulated together: all
// keeps a loaded vector in a register, so that the compiler does not fold its load into every FMA that uses it
#define IN_REGISTER(x) asm("" : "+v"(x))
#else
// 8 floats: one AVX2 register (16 of them). 16-float vectors, two registers each, needed 32 accumulators for a
// tile's scores (4 rows x 4 vectors) and spilled them to the stack on every FMA.
typedef float vf __attribute__((vector_size(32)));
constexpr int64_t VW = 8;
constexpr int64_t NS = 2;  // RG x NS = 8 accumulators, NS key vectors and a broadcast: 11 of the 16 registers
template <int64_t D> constexpr int64_t RP = 2;  // 2 rows x XC = 8 accumulators, XC value vectors and a broadcast
template <int64_t D> constexpr int64_t XC = D / VW < 4 ? D / VW : 4;
#ifdef __AVX2__
#define IN_REGISTER(x) asm("" : "+x"(x))
#else
#define IN_REGISTER(x) (void)0
#endif
#endif
constexpr int64_t ROW_PAD = 8;  // a block's rows are padded to a multiple of this (of RG and every RP)

inline vf vload(const float* p) { vf x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void vstore(float* p, vf x) { __builtin_memcpy(p, &x, sizeof x); }
typedef int32_t vi __attribute__((vector_size(VW * 4)));

// a float in every lane; lane-wise max / min, with each width's own instructions (GCC turns vector compares and
// selects it cannot map to one instruction into scalar code)
#if defined(__AVX512F__)
inline vf vsplat(float x) { return (vf)_mm512_set1_ps(x); }
inline vf vmaxv(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
inline vf vminv(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
#elif defined(__AVX2__)
inline vf vsplat(float x) { return (vf)_mm256_set1_ps(x); }
inline vf vmaxv(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }  // NaN in a: b
inline vf vminv(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
#else
inline vf vsplat(float x) { return vf{} + x; }
inline vf vmaxv(vf a, vf b) { return a > b ? a : b; }
inline vf vminv(vf a, vf b) { return a < b ? a : b; }
#endif

// e^x lane by lane (Cephes' expf: 2^n times a degree-6 polynomial of the remainder; ~1 ulp); 0 below -87 (AVX-512:
// below about -104, 2^n applied by vscalefps)
#ifdef __AVX512F__
inline vf vexp(vf xv) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps((__m512)xv, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.f));  // -inf too
  const __m512 n = _mm512_roundscale_ps(x * wde_exp::LOG2E, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (vf)_mm512_scalef_ps(wde_exp::exp_remainder(wde_exp::exp_reduce(x, n)), n);
}
inline vf vweight(vf d) { return vexp(d); }  // e^d for d <= 0 (or -inf): the softmax weights
inline float vsum(vf x) { return _mm512_reduce_add_ps((__m512)x); }
inline float vmax(vf x) { return _mm512_reduce_max_ps((__m512)x); }
#else
// e^x lane by lane (Cephes' expf: 2^n times a degree-6 polynomial of the remainder; ~1 ulp); 0 below -87
inline vf vexp(vf x) {
  const vf live = vminv(vmaxv((x + 87.f) * 1e30f, vf{}), vf{} + 1.f);  // 0 at or below -87 (and -inf), else 1
  x = vminv(vmaxv(x, vf{} - 87.f), vf{} + 88.f);
  const vf magic = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * wde_exp::LOG2E + magic) - magic;
  const vf p = wde_exp::exp_remainder(wde_exp::exp_reduce(x, n));
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale * live;
}

// e^d for d <= 0 (or -inf), the softmax weights, in fewer instructions than vexp (the weights are most of a tile's
// exps): 2^x with x = d log2 e clamped at -127, as 2^n times Cephes' exp2f polynomial of x - n in [-1/2, 1/2] (~1
// ulp); n = -127 gives a zero exponent field, so e^d is exactly 0 below about -88 (and for -inf or NaN)
inline vf vweight(vf d) {
  const vf x = vmaxv(d * wde_exp::LOG2E, vsplat(-127.f));  // NaN in the first operand: -127
  const vf magic = vsplat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x + magic) - magic;
  const vf f = x - n;
  vf p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef __AVX2__
inline float vsum(vf x) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float vmax(vf x) {
  __m128 t = _mm_max_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
#else
inline float vsum(vf x) { float t = 0.f; for (int64_t i = 0; i < VW; ++i) t += x[i]; return t; }
inline float vmax(vf x) { float t = x[0]; for (int64_t i = 1; i < VW; ++i) t = std::max(t, x[i]); return t; }
#endif
#endif

// The keys and values of one task, converted once. Key tile t holds keys kc0 + t*KB .. + KB; keys past the task's
// range are zeros with a -inf bias. Float path: K as [tile][d][KB] floats, V as [key][d] floats. bf16 dot-product
// path: K as [tile][d/2][KB] pairs of bf16 (dimensions 2c, 2c+1 of a key), V as [key/2][d] pairs of bf16 (keys
// 2j, 2j+1 of a dimension).
struct KV {
  std::vector<float> kf, vf_, bias;
  std::vector<char> masked;  // per tile: whether a key of it is masked or missing
  std::vector<uint32_t> k2, v2;
};

// s[r][col:col+NV*VW] = qf[r] . kt[:, 0:NV*VW] for rows r0 .. r0+RG-1 (all of them in the buffers); kt: a tile's
// column col
template <int64_t D, int64_t NV>
inline void scores(const float (*qf)[D], const float* kt, float (*s)[KB], int64_t r0, int64_t col) {
  vf acc[RG][NV] = {};
  for (int64_t c = 0; c < D; ++c) {
    vf kc[NV];
    for (int64_t x = 0; x < NV; ++x) {
      vf t = vload(kt + c * KB + x * VW);
      IN_REGISTER(t);
      kc[x] = t;
    }
    for (int64_t r = 0; r < RG; ++r) {
      const float qv = qf[r0 + r][c];
      for (int64_t x = 0; x < NV; ++x) acc[r][x] += vsplat(qv) * kc[x];
    }
  }
  for (int64_t r = 0; r < RG; ++r)
    for (int64_t x = 0; x < NV; ++x) vstore(&s[r0 + r][col + x * VW], acc[r][x]);
}

// acc[r] = acc[r] * alpha[r] + s[r][0:nk] . vt[0:nk] for rows r0 .. r0+RP-1, XC vectors of the output at a time
template <int64_t D>
inline void accumulate(float (*acc)[D], const float* vt, const float (*s)[KB], const float* alpha, int64_t r0,
                       int64_t nk) {
  static_assert((D / VW) % XC<D> == 0);
  for (int64_t c0 = 0; c0 < D; c0 += XC<D> * VW) {
    vf o[RP<D>][XC<D>];
    for (int64_t r = 0; r < RP<D>; ++r)
      for (int64_t x = 0; x < XC<D>; ++x) o[r][x] = vload(&acc[r0 + r][c0 + x * VW]) * vsplat(alpha[r0 + r]);
    for (int64_t j = 0; j < nk; ++j) {
      vf vj[XC<D>];
      for (int64_t x = 0; x < XC<D>; ++x) {
        vf t = vload(vt + j * D + c0 + x * VW);
        IN_REGISTER(t);
        vj[x] = t;
      }
      for (int64_t r = 0; r < RP<D>; ++r) {
        const float p = s[r0 + r][j];
        for (int64_t x = 0; x < XC<D>; ++x) o[r][x] += vsplat(p) * vj[x];
      }
    }
    for (int64_t r = 0; r < RP<D>; ++r)
      for (int64_t x = 0; x < XC<D>; ++x) vstore(&acc[r0 + r][c0 + x * VW], o[r][x]);
  }
}

#ifdef __AVX512BF16__
static_assert(NS == KB / VW, "the bf16 path computes a whole tile's scores at once");
inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// acc[r] = acc[r] * alpha[r] + p2[r][0:np] . v2[0:np] for rows r0 .. r0+RP-1; p2 / v2 are pairs of bf16 along keys
template <int64_t D>
inline void accumulate_bf16(float (*acc)[D], const uint32_t* vt, const uint32_t (*p2)[KB / 2], const float* alpha,
                            int64_t r0, int64_t np) {
  __m512 o[RP<D>][D / VW];
  for (int64_t r = 0; r < RP<D>; ++r)
    for (int64_t x = 0; x < D / VW; ++x)
      o[r][x] = _mm512_mul_ps(_mm512_loadu_ps(&acc[r0 + r][x * VW]), _mm512_set1_ps(alpha[r0 + r]));
  for (int64_t j = 0; j < np; ++j) {  // v2 row j: D pairs (keys 2j, 2j+1), D / VW registers of 16 pairs
    __m512i vj[D / VW];
    for (int64_t x = 0; x < D / VW; ++x) {
      __m512i t = _mm512_loadu_si512(vt + j * D + x * VW);
      IN_REGISTER(t);
      vj[x] = t;
    }
    for (int64_t r = 0; r < RP<D>; ++r) {
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(p2[r0 + r][j])));
      for (int64_t x = 0; x < D / VW; ++x) o[r][x] = _mm512_dpbf16_ps(o[r][x], p, as_bh(vj[x]));
    }
  }
  for (int64_t r = 0; r < RP<D>; ++r)
    for (int64_t x = 0; x < D / VW; ++x) _mm512_storeu_ps(&acc[r0 + r][x * VW], o[r][x]);
}

constexpr bool HAS_DPBF16 = true;
#else
constexpr bool HAS_DPBF16 = false;
#endif

// f(std::integral_constant<int64_t, min(nv, N)>) for nv >= 1: kernels specialized for nv vectors of keys
template <int64_t N = NS, typename F>
inline void with_width(int64_t nv, F&& f) {
  if constexpr (N > 1) {
    if (nv < N) return with_width<N - 1>(nv, f);
  }
  return f(std::integral_constant<int64_t, N>{});
}

// the keys [kc0, kc1) of one sequence and kv head, converted into kv for the float path
template <typename scalar_t, int64_t D>
void load_kv(const Problem& pb, const Packed<const scalar_t>& k, const Packed<const scalar_t>& v, int64_t start,
             int64_t kvh, int64_t kc0, int64_t kc1, KV& kv) {
  constexpr int64_t d = D;
  const int64_t dr = pb.d;  // dimensions read; d - dr zeros after them
  const int64_t n = kc1 - kc0;
  const int64_t tiles = (n + KB - 1) / KB;
  kv.bias.resize(tiles * KB);
  kv.masked.assign(tiles, 0);
  const int64_t kpad = (n + VW - 1) / VW * VW;  // a tile's keys are read in vectors of VW
  for (int64_t j = 0; j < tiles * KB; ++j) {
    kv.bias[j] = j >= n ? NEG_INF : (pb.key_mask == nullptr || pb.key_mask[start + kc0 + j]) ? 0.f : NEG_INF;
    if (kv.bias[j] != 0.f) kv.masked[j / KB] = 1;
  }
  kv.kf.resize(tiles * d * KB);
  kv.vf_.resize(tiles * KB * d);
  for (int64_t j = n; j < kpad; ++j) {  // keys past the range that are read: zeros in K (their V rows are not)
    float* kt = kv.kf.data() + (j / KB) * d * KB + j % KB;
    for (int64_t c = 0; c < d; ++c) kt[c * KB] = 0.f;
  }
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* ks = k.row(start + kc0 + j, kvh);
    const scalar_t* vs = v.row(start + kc0 + j, kvh);
    float* kt = kv.kf.data() + (j / KB) * d * KB + j % KB;
    for (int64_t c = 0; c < dr; ++c) kt[c * KB] = static_cast<float>(ks[c]);
    for (int64_t c = dr; c < d; ++c) kt[c * KB] = 0.f;
    float* vt = kv.vf_.data() + j * d;
    for (int64_t c = 0; c < dr; ++c) vt[c] = static_cast<float>(vs[c]);
    for (int64_t c = dr; c < d; ++c) vt[c] = 0.f;
  }
}

// the key tiles [t_begin, t_end) of a task's keys (from kc0 to kc1) that any of the rows q0 .. q0+rows-1 reaches
inline std::pair<int64_t, int64_t> block_tiles(const Problem& pb, int64_t len, int64_t q0, int64_t rows, int64_t kc0,
                                               int64_t kc1) {
  const int64_t last = q0 + rows - 1;
  const int64_t k_begin = std::max<int64_t>(0, q0 - pb.left);
  int64_t k_end = std::min(len, last + std::min(pb.right, len) + 1);
  if (pb.causal) k_end = std::min(k_end, last + 1);
  return {std::max<int64_t>(0, k_begin - kc0) / KB, (std::min(k_end, kc1) - kc0 + KB - 1) / KB};
}

// the keys of the tile at kb (nk keys) that row i may attend, as [lo, hi) within the tile (hi <= lo: none; none for
// a padding row, real false)
inline std::pair<int64_t, int64_t> row_keys(const Problem& pb, int64_t len, int64_t i, bool real, int64_t kb,
                                            int64_t nk) {
  const int64_t lo = std::max<int64_t>(i - pb.left, kb) - kb;
  const int64_t reach = pb.causal ? i : i + std::min(pb.right, len);
  return {lo, real ? std::min<int64_t>(reach, kb + nk - 1) - kb + 1 : 0};
}

// One query block (rows q0 .. q0+QB-1 of a sequence, one head) against the task's converted keys kv (from kc0):
// the float path.
template <typename scalar_t, int64_t D>
void attend_block(const Problem& pb, const Packed<const scalar_t>& q, const Packed<scalar_t>& out, const KV& kv,
                  int64_t start, int64_t len, int64_t q0, int64_t head, int64_t kc0, int64_t kc1) {
  static_assert(D % VW == 0, "head sizes of whole vectors (a smaller head is read zero-padded to one)");
  constexpr int64_t d = D;
  const int64_t dr = pb.d;  // dimensions read and written
  const int64_t rows = std::min(QB, len - q0);
  const int64_t rows_padded = (rows + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
  alignas(64) float qf[QB][D];
  alignas(64) float acc[QB][D];
  alignas(64) float s[QB][KB];
  alignas(64) float m[QB], mnew[QB], alpha[QB];
  vf lv[QB];  // each row's sum of weights, VW lanes
  bool live[QB];
  std::fill(m, m + QB, NEG_INF);
  std::fill(mnew, mnew + QB, NEG_INF);
  for (int64_t r = 0; r < rows_padded; ++r) {
    const scalar_t* src = r < rows ? q.row(start + q0 + r, head) : nullptr;
    if (q0 + QB + r < len)  // the next block's row (strided rows: the hardware prefetcher does not follow them)
      for (int64_t c = 0; c < dr * (int64_t)sizeof(scalar_t); c += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(q.row(start + q0 + QB + r, head)) + c);
    for (int64_t c = 0; c < d; ++c) qf[r][c] = src && c < dr ? static_cast<float>(src[c]) * pb.scale : 0.f;
    for (int64_t c = 0; c < d; ++c) acc[r][c] = 0.f;
    lv[r] = vf{};
  }
  const auto [t_begin, t_end] = block_tiles(pb, len, q0, rows, kc0, kc1);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t kb = kc0 + t * KB;
    const int64_t nk = std::min(KB, kc1 - kb);
    const float* kbias = kv.bias.data() + t * KB;
    const int64_t nv = (nk + VW - 1) / VW;  // vectors of keys computed: s[:, 0:width]
    const int64_t width = nv * VW;
    const float* kt = kv.kf.data() + t * D * KB;
    for (int64_t r0 = 0; r0 < rows_padded; r0 += RG)
      for (int64_t x0 = 0; x0 < nv; x0 += NS)
        with_width(nv - x0, [&](auto w) { scores<D, w>(qf, kt + x0 * VW, s, r0, x0 * VW); });
    // pass 1: mask the keys each row may not attend (only in tiles that need it); the rows' new running maxima
    const bool clean = !kv.masked[t];
    for (int64_t r = 0; r < rows_padded; ++r) {
      float* sr = s[r];
      const int64_t i = q0 + r;
      // allowed keys of row i within the tile: [lo, hi)
      const auto [lo, hi] = row_keys(pb, len, i, r < rows, kb, nk);
      live[r] = hi > lo;
      mnew[r] = m[r];
      if (!live[r]) continue;
      if (!clean || lo > 0 || hi < width) {
        for (int64_t j = 0; j < width; ++j) sr[j] += kbias[j];
        for (int64_t j = 0; j < lo; ++j) sr[j] = NEG_INF;
        for (int64_t j = hi; j < width; ++j) sr[j] = NEG_INF;
      }
      vf mv = vload(sr);
      for (int64_t x = 1; x < nv; ++x) { const vf u = vload(sr + x * VW); mv = vmaxv(mv, u); }
      mnew[r] = std::max(m[r], vmax(mv));
    }
    // how much each row's output and sum shrink, VW rows at a time: e^(old max - new max)
    for (int64_t r = 0; r < rows_padded; r += VW) {
      // a row with no key yet (max -inf) has nothing to shrink: its factor (0 here) multiplies zeros
      vstore(alpha + r, vexp(vload(m + r) - vmaxv(vload(mnew + r), vf{} - std::numeric_limits<float>::max())));
    }
    // pass 2: the weights e^(s - max) (zeros for a row with no key here), added to the row's sum
    for (int64_t r = 0; r < rows_padded; ++r) {
      float* sr = s[r];
      if (!live[r] || mnew[r] == NEG_INF) {  // no key for this row in this tile (or yet): it keeps its state
        for (int64_t j = 0; j < KB; ++j) sr[j] = 0.f;
      } else {
        vf sv = {};
        for (int64_t x = 0; x < nv; ++x) {
          const vf e = vweight(vload(sr + x * VW) - vsplat(mnew[r]));
          vstore(sr + x * VW, e);
          sv += e;
        }
        lv[r] = lv[r] * vsplat(alpha[r]) + sv;
        m[r] = mnew[r];
      }
    }
    const float* vt = kv.vf_.data() + t * KB * D;
    for (int64_t r0 = 0; r0 < rows_padded; r0 += RP<D>) accumulate<D>(acc, vt, s, alpha, r0, nk);
  }
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = out.row(start + q0 + r, head);
    const float l = vsum(lv[r]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t c = 0; c < dr; ++c) dst[c] = static_cast<scalar_t>(acc[r][c] * inv);
  }
}

#ifdef __AVX512BF16__
// ---- The bf16 dot-product path: the softmax of a tile runs on the scores while they are still in registers ----

// A masked score on the bf16 dot-product path: finite, so that the weights' exp needs no clamp (a score plus this is
// this), and far below any real score; a row whose maximum is at or below MASKED_MAX has no key yet.
constexpr float MASKED = -1e30f;
constexpr float MASKED_MAX = -1e29f;

// 2^x lane by lane for x <= 0 (the softmax weights, in base 2): 2^n, n = x rounded to the nearest integer, times a
// degree-4 polynomial of x - n in [-1/2, 1/2] (relative error 2.7e-6, far below the bf16 rounding the weights then
// take); exactly 0 for a masked score's x (MASKED times the scale, or less).
inline __m512 exp2_weights(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.571397677063942e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917978286743164e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024713039398193e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217908859253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847442627e-1f));
  return _mm512_scalef_ps(p, n);
}

// the lanes [a, b) of a vector of 16 keys, as a mask (none where b <= a)
inline __mmask16 lane_range(int64_t a, int64_t b) {
  a = std::clamp<int64_t>(a, 0, VW);
  b = std::clamp<int64_t>(b, 0, VW);
  return b > a ? static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u)) : 0;
}

struct RowState {  // a query block's online softmax, row by row
  alignas(64) float m[QB];       // running maximum of the raw scores q . k
  alignas(64) float alpha[QB];   // this tile's factor on each row's output so far
  __m512 l[QB];                  // running sum of the weights, 16 lanes
  // this tile's keys a row may attend: where uniform, tile_lanes for every row below `rows` (all of the tile's
  // computed keys where tile_full) and none for the padding rows; else lanes of a row where not all of them (full)
  bool uniform, tile_full;
  int64_t rows;
  __mmask16 tile_lanes[KB / VW];
  __mmask16 lanes[QB][KB / VW];
  bool full[QB];
};

// Rows r0 .. r0+RG-1 against one key tile (its first NV vectors of keys): the raw scores q2 . k2 in registers,
// masked (key-mask bias, then each row's lanes), the rows' new maxima, the factors alpha = 2^((old - new max) c),
// the weights 2^((s - new max) c) added to the rows' sums and rounded to bf16 pairs of keys in p2. c = scale log2 e.
// FROM_S: the raw scores were computed already (AMX tiles) into s [QB][KB]; they are loaded instead.
template <int64_t D, int64_t NV, bool FROM_S = false>
inline void softmax_tile(const uint32_t (*q2)[D / 2], const uint32_t* kt, const float* kbias, float c, int64_t r0,
                         RowState& st, uint32_t (*p2)[KB / 2], const float (*s)[KB] = nullptr) {
  __m512 acc[RG][NV];
  for (int64_t r = 0; r < RG; ++r)
    for (int64_t x = 0; x < NV; ++x) acc[r][x] = FROM_S ? _mm512_load_ps(s[r0 + r] + x * VW) : _mm512_setzero_ps();
  if constexpr (!FROM_S) for (int64_t cc = 0; cc < D / 2; ++cc) {
    __m512i kc[NV];
    for (int64_t x = 0; x < NV; ++x) {
      __m512i t = _mm512_loadu_si512(kt + cc * KB + x * VW);
      IN_REGISTER(t);
      kc[x] = t;
    }
    for (int64_t r = 0; r < RG; ++r) {
      const __m512bh qv = as_bh(_mm512_set1_epi32(static_cast<int>(q2[r0 + r][cc])));
      for (int64_t x = 0; x < NV; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], qv, as_bh(kc[x]));
    }
  }
  static_assert(RG == 4, "the maxima of a tile's rows are reduced four at a time, one per 128-bit lane");
  const __m512 neg = _mm512_set1_ps(MASKED), cv = _mm512_set1_ps(c);
  __m512 mx[RG];
  for (int64_t r = 0; r < RG; ++r) {
    const int64_t i = r0 + r;
    mx[r] = neg;
    for (int64_t x = 0; x < NV; ++x) {
      if (kbias != nullptr) acc[r][x] = _mm512_add_ps(acc[r][x], _mm512_loadu_ps(kbias + x * VW));
      if (st.uniform ? i >= st.rows || !st.tile_full : !st.full[i])
        acc[r][x] = _mm512_mask_mov_ps(neg, st.uniform ? (i < st.rows ? st.tile_lanes[x] : 0) : st.lanes[i][x],
                                       acc[r][x]);
      mx[r] = _mm512_max_ps(mx[r], acc[r][x]);
    }
  }
  // the four rows' maxima at once: row r's in every lane of 128-bit lane r
  const __m512 m01 = _mm512_max_ps(_mm512_shuffle_f32x4(mx[0], mx[1], 0x44), _mm512_shuffle_f32x4(mx[0], mx[1], 0xee));
  const __m512 m23 = _mm512_max_ps(_mm512_shuffle_f32x4(mx[2], mx[3], 0x44), _mm512_shuffle_f32x4(mx[2], mx[3], 0xee));
  __m512 tmax = _mm512_max_ps(_mm512_shuffle_f32x4(m01, m23, 0x88), _mm512_shuffle_f32x4(m01, m23, 0xdd));
  tmax = _mm512_max_ps(tmax, _mm512_permute_ps(tmax, 0x4e));
  tmax = _mm512_max_ps(tmax, _mm512_permute_ps(tmax, 0xb1));
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 mold = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(st.m + r0)));
  const __m512 mnew = _mm512_max_ps(mold, tmax);
  // a row with no key yet (its new max is a masked score's) keeps its state: factor 1, weights zeros
  const __mmask16 none = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(MASKED_MAX), _CMP_LE_OQ);
  const __m512 alpha = exp2_weights(_mm512_maskz_mul_ps(~none, _mm512_sub_ps(mold, mnew), cv));
  const __m512 mc = _mm512_maskz_mul_ps(~none, mnew, cv);
  const __m512i gather = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  _mm_storeu_ps(st.m + r0, _mm512_castps512_ps128(_mm512_permutexvar_ps(gather, mnew)));
  _mm_storeu_ps(st.alpha + r0, _mm512_castps512_ps128(_mm512_permutexvar_ps(gather, alpha)));
  for (int64_t r = 0; r < RG; ++r) {
    const int64_t i = r0 + r;
    const __m512 mcr = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(4 * r)), mc);
    __m512 e[NV + NV % 2];
    __m512 sum = _mm512_setzero_ps();
    for (int64_t x = 0; x < NV; ++x) {
      e[x] = exp2_weights(_mm512_fmsub_ps(acc[r][x], cv, mcr));
      sum = _mm512_add_ps(sum, e[x]);
    }
    if constexpr (NV % 2 != 0) e[NV] = _mm512_setzero_ps();
    for (int64_t x = 0; x < NV; x += 2)
      _mm512_store_si512(p2[i] + x * VW / 2, (__m512i)_mm512_cvtne2ps_pbh(e[x + 1], e[x]));
    const __m512 ar = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(4 * r)), alpha);
    st.l[i] = _mm512_fmadd_ps(st.l[i], ar, sum);
  }
}

#ifdef WDE_AMX
// AMX (Sapphire Rapids and later): Q.K^T and P.V as tile products (tdpbf16ps: 16 x 16 float32 outputs from 16 x 32
// bf16 inputs, in one instruction) on the same bf16 pair layouts the vdpbf16ps path uses; the softmax stays in
// AVX-512 registers, reading the scores back from an L1 buffer. Linux grants a process AMX's tile state only on
// request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); where that fails the vdpbf16ps path runs.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
std::atomic<bool> amx_wanted{true};  // set_amx(False): the vdpbf16ps path on an AMX host (tests compare the two)
inline bool use_amx() { return amx_wanted.load(std::memory_order_relaxed) && amx_permitted(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// all eight tiles 16 rows of 64 bytes: 16 x 16 float32 outputs, 16 rows of 32 bf16 (16 pairs) as inputs. The two
// products below use them as four outputs, two left and two right inputs: the four products of a step are
// independent, so the tile unit overlaps them, and each input loaded serves two products
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// s[r][x * 16 ..] = q2[r] . K of the tile's key vector x, for rows [0, rows) (a multiple of 16), vectors [0, nv).
// Tiles: outputs 0 (rows h, keys x), 4 (h, x+1), 3 (h+16, x), 5 (h+16, x+1); queries 1 (rows h), 6 (h+16); keys 2
// (vector x), 7 (x+1)
template <int64_t D>
inline void scores_amx(const uint32_t (*q2)[D / 2], const uint32_t* kt, int64_t rows, int64_t nv, float (*s)[KB]) {
  for (int64_t h = 0; h < rows; h += 32) {
    const bool two = h + 16 < rows;
    for (int64_t x = 0; x < nv; x += 2) {
      const bool pair = x + 1 < nv;
      _tile_zero(0);
      _tile_zero(4);
      _tile_zero(3);
      _tile_zero(5);
      for (int64_t cc = 0; cc < D / 2; cc += 16) {  // 32 dimensions (16 pairs) a product
        _tile_loadd(1, q2[h] + cc, D / 2 * 4);
        _tile_loadd(2, kt + cc * KB + x * VW, KB * 4);
        _tile_dpbf16ps(0, 1, 2);
        if (pair) {
          _tile_loadd(7, kt + cc * KB + (x + 1) * VW, KB * 4);
          _tile_dpbf16ps(4, 1, 7);
        }
        if (two) {
          _tile_loadd(6, q2[h + 16] + cc, D / 2 * 4);
          _tile_dpbf16ps(3, 6, 2);
          if (pair) _tile_dpbf16ps(5, 6, 7);
        }
      }
      _tile_stored(0, s[h] + x * VW, KB * 4);
      if (pair) _tile_stored(4, s[h] + (x + 1) * VW, KB * 4);
      if (two) {
        _tile_stored(3, s[h + 16] + x * VW, KB * 4);
        if (pair) _tile_stored(5, s[h + 16] + (x + 1) * VW, KB * 4);
      }
    }
  }
}

// acc[r] = acc[r] * alpha[r] + p2[r][0:np] . v2[0:np] for rows [0, rows) (a multiple of 16); np rounded up to 16
// pairs (p2's weights there are zeros, and v2's pairs zeros past the keys). Tiles: outputs 0 (rows h, dimensions g),
// 3 (h, g+16), 4 (h+16, g), 5 (h+16, g+16); weights 1 (rows h), 6 (h+16); values 2 (dimensions g), 7 (g+16)
template <int64_t D>
inline void accumulate_amx(float (*acc)[D], const uint32_t* vt, const uint32_t (*p2)[KB / 2], const float* alpha,
                           int64_t rows, int64_t np) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t x = 0; x < D; x += VW) _mm512_store_ps(acc[r] + x, _mm512_mul_ps(_mm512_load_ps(acc[r] + x), a));
  }
  static_assert(D % 32 == 0, "dimensions are taken 32 at a time");
  for (int64_t h = 0; h < rows; h += 32) {
    const bool two = h + 16 < rows;
    for (int64_t g = 0; g < D; g += 32) {
      _tile_loadd(0, acc[h] + g, D * 4);
      _tile_loadd(3, acc[h] + g + 16, D * 4);
      if (two) {
        _tile_loadd(4, acc[h + 16] + g, D * 4);
        _tile_loadd(5, acc[h + 16] + g + 16, D * 4);
      }
      for (int64_t j = 0; j < np; j += 16) {  // 16 pairs of keys a product
        _tile_loadd(1, p2[h] + j, KB / 2 * 4);
        _tile_loadd(2, vt + j * D + g, D * 4);
        _tile_loadd(7, vt + j * D + g + 16, D * 4);
        _tile_dpbf16ps(0, 1, 2);
        _tile_dpbf16ps(3, 1, 7);
        if (two) {
          _tile_loadd(6, p2[h + 16] + j, KB / 2 * 4);
          _tile_dpbf16ps(4, 6, 2);
          _tile_dpbf16ps(5, 6, 7);
        }
      }
      _tile_stored(0, acc[h] + g, D * 4);
      _tile_stored(3, acc[h] + g + 16, D * 4);
      if (two) {
        _tile_stored(4, acc[h + 16] + g, D * 4);
        _tile_stored(5, acc[h + 16] + g + 16, D * 4);
      }
    }
  }
}
#endif

// a row of D values as D / 2 pairs of bf16 (float ones rounded to nearest even); only its first n values are read
// (a head smaller than the template's D), the rest are zeros: masked loads, which read nothing past them
template <int64_t D>
inline void load_pairs(const c10::BFloat16* src, uint32_t* dst, int64_t n = D) {
  for (int64_t c = 0; c < D; c += 2 * VW) {
    const __m512i x = n >= c + 2 * VW ? _mm512_loadu_si512(src + c) : _mm512_maskz_loadu_epi16(
        __mmask32(lane_range(0, n - c)) | __mmask32(lane_range(0, n - c - VW)) << 16, src + c);
    _mm512_storeu_si512(dst + c / 2, x);
  }
}
template <int64_t D>
inline void load_pairs(const float* src, uint32_t* dst, int64_t n = D) {
  for (int64_t c = 0; c < D; c += 2 * VW) {
    const __m512 lo = n >= c + VW ? _mm512_loadu_ps(src + c) : _mm512_maskz_loadu_ps(lane_range(0, n - c), src + c);
    const __m512 hi = n >= c + 2 * VW ? _mm512_loadu_ps(src + c + VW)
                                      : _mm512_maskz_loadu_ps(lane_range(0, n - c - VW), src + c + VW);
    _mm512_storeu_si512(dst + c / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// 16 x 16 transpose of 32-bit lanes: r[c] then holds lane c of each of the 16 rows given
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + k], 128-bit lane L: rows 4g .. 4g+3 of column 4L + k
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    v[4 + k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    v[8 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    v[12 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(v[4 + k], v[12 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0xdd);
    r[12 + k] = _mm512_shuffle_i32x4(v[4 + k], v[12 + k], 0xdd);
  }
}

// the keys [kc0, kc1) of one sequence and kv head, converted for the bf16 dot-product path: K as [tile][D/2][KB]
// pairs of bf16 (dimensions 2c, 2c+1 of a key; 16 keys at a time through a 16 x 16 transpose), V as [key/2][D]
// pairs of bf16 (keys 2j, 2j+1 of a dimension; two rows interleaved). Keys past the range that are read are zeros.
template <typename scalar_t, int64_t D>
void load_kv_dp(const Problem& pb, const Packed<const scalar_t>& k, const Packed<const scalar_t>& v, int64_t start,
                int64_t kvh, int64_t kc0, int64_t kc1, KV& kv) {
  const int64_t n = kc1 - kc0;
  const int64_t tiles = (n + KB - 1) / KB;
  kv.masked.assign(tiles, 0);
  if (pb.key_mask != nullptr) {  // a MASKED bias on masked keys, and which tiles hold one
    kv.bias.resize(tiles * KB);
    for (int64_t j = 0; j < tiles * KB; ++j) {
      kv.bias[j] = j < n && pb.key_mask[start + kc0 + j] ? 0.f : MASKED;
      if (j < n && kv.bias[j] != 0.f) kv.masked[j / KB] = 1;
    }
  }
  kv.k2.resize(tiles * (D / 2) * KB);
  kv.v2.resize(tiles * (KB / 2) * D);
  const auto prefetch = [&](const Packed<const scalar_t>& x, int64_t j) {  // key j's row of x, if in the range
    if (j < n) _mm_prefetch(reinterpret_cast<const char*>(x.row(start + kc0 + j, kvh)), _MM_HINT_T0);
  };
  for (int64_t j = 0; j < VW; ++j) prefetch(k, j);
  for (int64_t j0 = 0; j0 < n; j0 += VW) {
    for (int64_t j = j0; j < j0 + VW; ++j) {  // the next 16 keys' K rows and these 16 keys' V rows, read later
      prefetch(k, j + VW);
      prefetch(v, j);
    }
    uint32_t* kt = kv.k2.data() + (j0 / KB) * (D / 2) * KB + j0 % KB;
    for (int64_t cc = 0; cc < D / 2; cc += VW) {  // 16 pairs of dimensions of 16 keys
      __m512i r[VW];
      for (int64_t jj = 0; jj < VW; ++jj) {
        alignas(64) uint32_t row[D / 2];
        if (j0 + jj < n) {
          load_pairs<2 * VW>(k.row(start + kc0 + j0 + jj, kvh) + 2 * cc, row, pb.d - 2 * cc);
          r[jj] = _mm512_load_si512(row);
        } else {
          r[jj] = _mm512_setzero_si512();
        }
      }
      transpose16(r);
      for (int64_t c = 0; c < VW; ++c) _mm512_storeu_si512(kt + (cc + c) * KB, r[c]);
    }
  }
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < n; j += 2) {  // keys j, j+1 (zeros past the range), 32 dimensions at a time
    uint32_t* vt = kv.v2.data() + (j / 2) * D;
    for (int64_t c = 0; c < D; c += 2 * VW) {
      alignas(64) uint32_t a[VW], b[VW];
      load_pairs<2 * VW>(v.row(start + kc0 + j, kvh) + c, a, pb.d - c);
      if (j + 1 < n) load_pairs<2 * VW>(v.row(start + kc0 + j + 1, kvh) + c, b, pb.d - c);
      else std::fill(b, b + VW, 0u);
      const __m512i x = _mm512_load_si512(a), y = _mm512_load_si512(b);
      _mm512_storeu_si512(vt + c, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vt + c + VW, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
  // the last tile's pairs past the keys: zeros (not an earlier task's values), as AMX reads 16 pairs at a time
  std::fill(kv.v2.begin() + (n + 1) / 2 * D, kv.v2.end(), 0u);
}

// One query block (rows q0 .. q0+QB-1 of a sequence, one head) against the task's converted keys kv (from kc0):
// the bf16 dot-product path, its products as AMX tile products where `amx` (the worker configured the tiles).
template <typename scalar_t, int64_t D>
void attend_block_dp(const Problem& pb, const Packed<const scalar_t>& q, const Packed<scalar_t>& out, const KV& kv,
                     int64_t start, int64_t len, int64_t q0, int64_t head, int64_t kc0, int64_t kc1, bool amx) {
  const int64_t rows = std::min(QB, len - q0);
#ifdef WDE_AMX
  alignas(64) float s[QB][KB];  // the raw scores of a tile (AMX)
#endif
  const int64_t pad = amx ? 16 : ROW_PAD;  // AMX's tiles are 16 rows
  const int64_t rows_padded = (rows + pad - 1) / pad * pad;
  alignas(64) uint32_t q2[QB][D / 2];
  alignas(64) float acc[QB][D];
  alignas(64) uint32_t p2[QB][KB / 2];
  RowState st;
  for (int64_t r = 0; r < std::min(QB, len - q0 - QB); ++r)  // the next block's queries, while this one runs
    _mm_prefetch(reinterpret_cast<const char*>(q.row(start + q0 + QB + r, head)), _MM_HINT_T0);
  for (int64_t r = 0; r < rows_padded; ++r) {
    if (r < rows) load_pairs<D>(q.row(start + q0 + r, head), q2[r], pb.d);
    else std::fill(q2[r], q2[r] + D / 2, 0u);
    std::fill(acc[r], acc[r] + D, 0.f);
    st.m[r] = MASKED;
    st.l[r] = _mm512_setzero_ps();
  }
  const float c = pb.scale * wde_exp::LOG2E;
  const bool global = !pb.causal && pb.left >= len && pb.right >= len;
  st.uniform = global;  // every row reaches every key of a tile: one mask per tile for them all
  st.rows = rows;
  const auto [t_begin, t_end] = block_tiles(pb, len, q0, rows, kc0, kc1);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t kb = kc0 + t * KB;
    const int64_t nk = std::min(KB, kc1 - kb);
    const int64_t nv = (nk + VW - 1) / VW;  // vectors of keys computed
    st.tile_full = nk == nv * VW;
    for (int64_t x = 0; x < nv; ++x) st.tile_lanes[x] = lane_range(-x * VW, nk - x * VW);
    if (!global) for (int64_t r = 0; r < rows_padded; ++r) {  // the keys of the tile each row may attend: [lo, hi)
      const int64_t i = q0 + r;
      const auto [lo, hi] = row_keys(pb, len, i, r < rows, kb, nk);
      st.full[r] = lo == 0 && hi == nv * VW;
      if (!st.full[r])
        for (int64_t x = 0; x < nv; ++x) st.lanes[r][x] = lane_range(lo - x * VW, hi - x * VW);
    }
    const float* kbias = kv.masked[t] ? kv.bias.data() + t * KB : nullptr;
    const uint32_t* kt = kv.k2.data() + t * (D / 2) * KB;
    const uint32_t* vt = kv.v2.data() + t * (KB / 2) * D;
#ifdef WDE_AMX
    if (amx) {
      scores_amx<D>(q2, kt, rows_padded, nv, s);
      with_width(nv, [&](auto w) {
        for (int64_t r0 = 0; r0 < rows_padded; r0 += RG) softmax_tile<D, w, true>(q2, kt, kbias, c, r0, st, p2, s);
      });
      accumulate_amx<D>(acc, vt, p2, st.alpha, rows_padded, (nk + 31) / 32 * 16);
      continue;
    }
#endif
    with_width(nv, [&](auto w) {
      for (int64_t r0 = 0; r0 < rows_padded; r0 += RG) softmax_tile<D, w>(q2, kt, kbias, c, r0, st, p2);
    });
    for (int64_t r0 = 0; r0 < rows_padded; r0 += RP<D>) accumulate_bf16<D>(acc, vt, p2, st.alpha, r0, (nk + 1) / 2);
  }
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = out.row(start + q0 + r, head);
    const float l = _mm512_reduce_add_ps(st.l[r]);
    const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
    for (int64_t x = 0; x < pb.d; x += VW) {  // the head's own dimensions (a smaller head: masked stores)
      const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc[r] + x), inv);
      const __mmask16 lanes = lane_range(0, pb.d - x);
      if constexpr (std::is_same_v<scalar_t, float>) _mm512_mask_storeu_ps(dst + x, lanes, o);
      else _mm256_mask_storeu_epi16(dst + x, lanes, (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}
#endif

// the keys [kc0, kc1) that query rows [r0, r1) of a sequence of length len may reach
inline std::pair<int64_t, int64_t> key_range(const Problem& pb, int64_t len, int64_t r0, int64_t r1) {
  const int64_t kc0 = std::max<int64_t>(0, r0 - pb.left);
  int64_t kc1 = std::min(len, r1 - 1 + std::min(pb.right, len) + 1);
  if (pb.causal) kc1 = std::min(kc1, r1);
  return {kc0, std::max(kc0, kc1)};
}

// (sequence, key/value head, run of query blocks) tasks, longest first: a task's keys and values are converted once
// for all the query heads of its group (GQA: Qwen3's 16 query heads read 8 key/value heads); a (sequence, kv head)
// is cut into runs only as far as needed for no task to exceed 1/4 of a thread's share of the work
std::vector<Task> plan(const Problem& pb, int64_t nseq, int64_t threads) {
  std::vector<int64_t> cost(nseq);
  int64_t total = 0;
  for (int64_t sidx = 0; sidx < nseq; ++sidx) {
    const int64_t len = pb.cu[sidx + 1] - pb.cu[sidx];
    const int64_t left = std::min(pb.left, len), right = pb.causal ? 0 : std::min(pb.right, len);
    const int64_t keys = pb.causal && left == len ? len / 2 + 1 : std::min(len, left + right + 1);  // per row
    cost[sidx] = len * std::max<int64_t>(1, keys) * (pb.hq / pb.hk);  // per kv head: its group's query heads
    total += cost[sidx] * pb.hk;
  }
  const int64_t cap = threads > 1 ? std::max<int64_t>(1, total / (4 * threads)) : std::numeric_limits<int64_t>::max();
  std::vector<Task> tasks;
  for (int64_t sidx = 0; sidx < nseq; ++sidx) {
    const int64_t len = pb.cu[sidx + 1] - pb.cu[sidx];
    const int64_t blocks = (len + QB - 1) / QB;
    if (blocks == 0) continue;
    const int64_t runs = std::clamp<int64_t>(cost[sidx] / cap + (cost[sidx] % cap != 0), 1, blocks);
    for (int64_t h = 0; h < pb.hk; ++h)
      for (int64_t r = 0; r < runs; ++r) {
        const int64_t b0 = blocks * r / runs, b1 = blocks * (r + 1) / runs;
        tasks.push_back({sidx, h, b0, b1, cost[sidx] * (b1 - b0) / blocks});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

// the first block's query rows of a task and the first keys' K and V rows it reads, towards L2 (GCC's portable
// prefetch: this part is built for every instruction set)
template <typename scalar_t>
void prefetch_task(const Problem& pb, const Packed<const scalar_t>& q, const Packed<const scalar_t>& k,
                   const Packed<const scalar_t>& v, const Task& task) {
  const int64_t start = pb.cu[task.seq], len = pb.cu[task.seq + 1] - start;
  const int64_t kvh = task.kvh;
  for (int64_t r = task.b0 * QB; r < std::min(len, task.b0 * QB + QB); ++r)  // the group's first query head
    __builtin_prefetch(q.row(start + r, kvh * (pb.hq / pb.hk)), 0, 2);
  const int64_t kc0 = key_range(pb, len, task.b0 * QB, std::min(len, task.b1 * QB)).first;
  for (int64_t j = kc0; j < std::min(len, kc0 + 2 * QB); ++j) {
    __builtin_prefetch(k.row(start + j, kvh), 0, 2);
    __builtin_prefetch(v.row(start + j, kvh), 0, 2);
  }
}

template <typename scalar_t, int64_t D, bool DP>
void run(const Problem& pb, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
         int64_t nseq) {
  const int64_t threads = at::get_num_threads();
  const std::vector<Task> tasks = plan(pb, nseq, threads);
  const Packed<const scalar_t> qp{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1)};
  const Packed<const scalar_t> kp{k.data_ptr<scalar_t>(), k.stride(0), k.stride(1)};
  const Packed<const scalar_t> vp{v.data_ptr<scalar_t>(), v.stride(0), v.stride(1)};
  const Packed<scalar_t> op{out.data_ptr<scalar_t>(), out.stride(0), out.stride(1)};
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  // one worker per thread, each taking the next task from the shared counter until none is left
  // AMX decided once per call, so every block of it agrees with the workers' tile configuration
#ifdef WDE_AMX
  const bool amx = DP && use_amx();
#else
  constexpr bool amx = false;
#endif
  at::parallel_for(0, std::min(threads, ntasks), 1, [&](int64_t, int64_t) {
    thread_local KV kv;
#ifdef WDE_AMX
    if (amx) amx_configure();  // per worker: oneDNN's kernels load their own tile configuration on these threads
#endif
    // each worker claims its next task before it runs the one in hand, so that the next one's first queries, keys
    // and values are on their way into the cache meanwhile (a short sequence's task is mostly waiting for them)
    for (int64_t t = next.fetch_add(1), after; t < ntasks; t = after) {
      after = next.fetch_add(1);
      if (after < ntasks) prefetch_task(pb, qp, kp, vp, tasks[after]);
      const Task& task = tasks[t];
      const int64_t start = pb.cu[task.seq], len = pb.cu[task.seq + 1] - start;
      const auto [kc0, kc1] = key_range(pb, len, task.b0 * QB, std::min(len, task.b1 * QB));
      const int64_t kvh = task.kvh, group = pb.hq / pb.hk, h0 = kvh * group;
#ifdef __AVX512BF16__
      if constexpr (DP) {
        for (int64_t r = task.b0 * QB; r < std::min(len, task.b0 * QB + QB); ++r)  // the first block's queries
          _mm_prefetch(reinterpret_cast<const char*>(qp.row(start + r, h0)), _MM_HINT_T0);
        load_kv_dp<scalar_t, D>(pb, kp, vp, start, kvh, kc0, kc1, kv);
        for (int64_t h = h0; h < h0 + group; ++h)
          for (int64_t b = task.b0; b < task.b1; ++b)
            attend_block_dp<scalar_t, D>(pb, qp, op, kv, start, len, b * QB, h, kc0, kc1, amx);
        continue;
      }
#endif
      load_kv<scalar_t, D>(pb, kp, vp, start, kvh, kc0, kc1, kv);
      for (int64_t h = h0; h < h0 + group; ++h)
        for (int64_t b = task.b0; b < task.b1; ++b)
          attend_block<scalar_t, D>(pb, qp, op, kv, start, len, b * QB, h, kc0, kc1);
    }
#ifdef WDE_AMX
    if (amx) _tile_release();
#endif
  });
}

// The head sizes the kernel is built for; a head of d dimensions runs at the smallest that holds it, its rows read
// zero-padded to that size in the kernel's loads and only its own d columns written. SigLIP so400m's 72 and CLIP
// ViT-H's 80 run at 96, TinyBERT's 26 at 32: faster than scalar loops over d, the wasted products included
// (docs/benchmarks.md).
constexpr int64_t HEAD_SIZES[] = {32, 64, 96, 128, 256};

template <typename scalar_t, bool DP, size_t I = 0>
void dispatch_dim(const Problem& pb, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                  int64_t nseq) {
  constexpr int64_t D = HEAD_SIZES[I];
  if (pb.d <= D) return run<scalar_t, D, DP>(pb, q, k, v, out, nseq);
  if constexpr (I + 1 < std::size(HEAD_SIZES)) return dispatch_dim<scalar_t, DP, I + 1>(pb, q, k, v, out, nseq);
  TORCH_CHECK(false, "cpu_flash: head_dim ", pb.d, " above ", D);
}

}  // namespace

// q [tokens, hq, d], k/v [tokens, hk, d] (unit stride on d), cu_seqlens int64 [seqs + 1] on CPU, key_mask bool
// [tokens] or None, window (left, right) with -1 for none. Returns a new [tokens, hq, d] tensor of q's dtype.
// bf16_products: float32 q/k/v take the bf16 dot-product path too (rounded to bf16 as they are loaded; the softmax
// and the outputs stay float32), where this build has it (bf16_dot_products()); else it changes nothing.
// out_rows (>= tokens, or -1: tokens): the output is the first `tokens` rows of a tensor of that many, so the linear
// after it (wde's cpu_linear.onednn_linear, which rounds its rows up by padded_rows) finds its padded rows in place.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                            const c10::optional<at::Tensor>& key_mask, bool causal, int64_t left, int64_t right,
                            double scale, bool bf16_products, int64_t out_rows) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "cpu_flash: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "cpu_flash: q/k/v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "cpu_flash: mixed dtypes");
  TORCH_CHECK(q.size(0) == k.size(0) && k.sizes() == v.sizes() && q.size(2) == k.size(2), "cpu_flash: shape mismatch");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "cpu_flash: query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) <= MAX_D, "cpu_flash: head_dim above ", MAX_D);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "cpu_flash: head_dim must be contiguous");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous(), "cpu_flash: cu_seqlens int64");
  const int64_t nseq = cu_seqlens.numel() - 1;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(nseq >= 0 && cu[0] == 0 && cu[nseq] == q.size(0), "cpu_flash: cu_seqlens must span the tokens");
  TORCH_CHECK(out_rows == -1 || out_rows >= q.size(0), "cpu_flash: out_rows (", out_rows, ") below the tokens");
  const bool* km = nullptr;
  if (key_mask.has_value()) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->is_contiguous() && key_mask->numel() == q.size(0),
                "cpu_flash: key_mask must be a contiguous bool [tokens]");
    km = key_mask->data_ptr<bool>();
  }
  constexpr int64_t NONE = std::numeric_limits<int32_t>::max();
  const Problem pb{cu, km, q.size(1), k.size(1), q.size(2), left < 0 ? NONE : left, right < 0 ? NONE : right,
                   causal, static_cast<float>(scale)};
  const int64_t rows = std::max(out_rows, q.size(0));
  at::Tensor out = at::empty({rows, q.size(1), q.size(2)}, q.options()).narrow(0, 0, q.size(0));
  if (q.scalar_type() == at::kFloat && bf16_products && HAS_DPBF16) {
    dispatch_dim<float, HAS_DPBF16>(pb, q, k, v, out, nseq);
  } else if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float, false>(pb, q, k, v, out, nseq);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16, HAS_DPBF16>(pb, q, k, v, out, nseq);
  } else {
    TORCH_CHECK(false, "cpu_flash: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

// whether bf16 inputs take the vdpbf16ps path in this build (AVX512-BF16 targeted at compile time)
bool bf16_dot_products() { return HAS_DPBF16; }

// whether that path's products run as AMX tile products in this build and process (AMX targeted at compile time,
// the tile state granted by Linux, not switched off by set_amx)
bool amx_tiles() {
#ifdef WDE_AMX
  return use_amx();
#else
  return false;
#endif
}

// on (the default) or off: AMX tile products where amx_tiles() can be true (tests run both paths on an AMX host)
void set_amx(bool on) {
#ifdef WDE_AMX
  amx_wanted = on;
#else
  (void)on;
#endif
}

// how many workers at::parallel_for starts for the kernel's tasks: torch's thread count, or 1 where this file was
// compiled without OpenMP (its parallel_for is inline: without -fopenmp it runs the whole range on the caller)
int64_t parallel_workers() {
  std::atomic<int64_t> workers{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { workers += 1; });
  return workers;
}

// the tasks a call with these sequences, query heads, key/value heads (-1: one per query head) and mask would run on
// `threads` threads, in the order they are taken: (sequence, key/value head, first query block, end query block) each
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> plan_tasks(const at::Tensor& cu_seqlens, int64_t heads,
                                                                       bool causal, int64_t left, int64_t right,
                                                                       int64_t threads, int64_t kv_heads) {
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous(), "cpu_flash: cu_seqlens int64");
  constexpr int64_t NONE = std::numeric_limits<int32_t>::max();
  kv_heads = kv_heads < 0 ? heads : kv_heads;
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "cpu_flash: query heads must be a multiple of key/value heads");
  const Problem pb{cu_seqlens.data_ptr<int64_t>(), nullptr, heads, kv_heads, 0, left < 0 ? NONE : left,
                   right < 0 ? NONE : right, causal, 1.f};
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
  for (const Task& t : plan(pb, cu_seqlens.numel() - 1, threads)) out.emplace_back(t.seq, t.kvh, t.b0, t.b1);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("varlen_attention", &varlen_attention, "packed varlen attention (CPU, float32 / bfloat16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens"), py::arg("key_mask"), py::arg("causal"),
        py::arg("left"), py::arg("right"), py::arg("scale"), py::arg("bf16_products") = false,
        py::arg("out_rows") = -1);
  m.def("bf16_dot_products", &bf16_dot_products, "whether bf16 inputs take the AVX512-BF16 dot-product path");
  m.def("amx_tiles", &amx_tiles, "whether that path's products run as AMX tile products");
  m.def("set_amx", &set_amx, "AMX tile products on (default) or off, where the build has them");
  m.def("parallel_workers", &parallel_workers, "how many threads run the kernel's tasks");
  m.def("plan_tasks", &plan_tasks, "the (sequence, kv head, first block, end block) tasks of a call, in order",
        py::arg("cu_seqlens"), py::arg("heads"), py::arg("causal"), py::arg("left"), py::arg("right"),
        py::arg("threads"), py::arg("kv_heads") = -1);
}
