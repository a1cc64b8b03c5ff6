// Packed varlen attention on CPU: one call for a whole batch of sequences packed as [tokens, heads, head_dim].
//
// Work is split into tasks of (sequence, query block of QB rows, head), run with at::parallel_for. A task keeps its
// queries (scaled, in float) and a running output in local buffers and walks the keys its rows can reach in tiles of
// KB keys with the online softmax (flash attention): no padding, no [len, len] score matrix, no gather. bf16 inputs
// are widened to float as they are loaded; dot products and the softmax run in float. A local window and the causal
// mask bound the key range of each row; a key mask (one bool per token) adds -inf to the scores of masked keys.
// A row left with no key to attend outputs zeros.
//
// The hot loops use GCC vector types (16 floats: one AVX-512 register, two AVX2 ones), with scores and outputs of
// 4 query rows held in registers, and a polynomial exp; head_dim is a template argument for 32, 64 and 128 (other
// sizes take plain loops). wde/components/attention/cpu_flash.py builds it for the host's own instruction set
// (-march=native), or for AVX2 under torch's AVX2 cap.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t QB = 32;  // query rows per task
constexpr int64_t KB = 64;  // keys per tile
constexpr int64_t MAX_D = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Problem {
  const int64_t* cu;
  const bool* key_mask;  // nullptr: every key may be attended
  int64_t hq, hk, d;
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

typedef float vf __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, two AVX2 ones
constexpr int64_t VW = 16;
constexpr int64_t RG = 4;  // query rows whose scores / outputs are accumulated together in registers

inline vf vload(const float* p) { vf x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void vstore(float* p, vf x) { __builtin_memcpy(p, &x, sizeof x); }
typedef int32_t vi __attribute__((vector_size(64)));

// e^x lane by lane (Cephes' expf: 2^n times a degree-6 polynomial of the remainder; ~1 ulp); 0 below -87
inline vf vexp(vf x) {
  const vf dead = x < -87.f ? vf{} + 1.f : vf{};
  x = x < -87.f ? vf{} - 87.f : x;
  x = x > 88.f ? vf{} + 88.f : x;
  const vf magic = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * x * x + x + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return dead != 0.f ? vf{} : p * scale;
}

inline float vsum(vf x) { float t = 0.f; for (int64_t i = 0; i < VW; ++i) t += x[i]; return t; }
inline float vmax(vf x) { float t = x[0]; for (int64_t i = 1; i < VW; ++i) t = std::max(t, x[i]); return t; }

// s[r][0:KB] = qf[r] . kt[:, 0:KB] for rows r0 .. r0+RG-1 (all of them in the buffers)
template <int64_t D>
inline void scores(const float (*qf)[D], const float (*kt)[KB], float (*s)[KB], int64_t r0) {
  vf acc[RG][KB / VW] = {};
  for (int64_t c = 0; c < D; ++c) {
    vf kc[KB / VW];
    for (int64_t x = 0; x < KB / VW; ++x) kc[x] = vload(&kt[c][x * VW]);
    for (int64_t r = 0; r < RG; ++r) {
      const float qv = qf[r0 + r][c];
      for (int64_t x = 0; x < KB / VW; ++x) acc[r][x] += qv * kc[x];
    }
  }
  for (int64_t r = 0; r < RG; ++r)
    for (int64_t x = 0; x < KB / VW; ++x) vstore(&s[r0 + r][x * VW], acc[r][x]);
}

// acc[r] = acc[r] * alpha[r] + s[r][0:nk] . vt[0:nk] for rows r0 .. r0+RG-1
template <int64_t D>
inline void accumulate(float (*acc)[D], const float (*vt)[D], const float (*s)[KB], const float* alpha, int64_t r0,
                       int64_t nk) {
  vf o[RG][D / VW];
  for (int64_t r = 0; r < RG; ++r)
    for (int64_t x = 0; x < D / VW; ++x) o[r][x] = vload(&acc[r0 + r][x * VW]) * alpha[r0 + r];
  for (int64_t j = 0; j < nk; ++j) {
    vf vj[D / VW];
    for (int64_t x = 0; x < D / VW; ++x) vj[x] = vload(&vt[j][x * VW]);
    for (int64_t r = 0; r < RG; ++r) {
      const float p = s[r0 + r][j];
      for (int64_t x = 0; x < D / VW; ++x) o[r][x] += p * vj[x];
    }
  }
  for (int64_t r = 0; r < RG; ++r)
    for (int64_t x = 0; x < D / VW; ++x) vstore(&acc[r0 + r][x * VW], o[r][x]);
}

template <typename scalar_t, int64_t D>
void attend_block(const Problem& pb, const Packed<const scalar_t>& q, const Packed<const scalar_t>& k,
                  const Packed<const scalar_t>& v, const Packed<scalar_t>& out, int64_t start, int64_t len,
                  int64_t q0, int64_t head) {
  constexpr bool VEC = D > 0 && D % VW == 0;
  constexpr int64_t DB = D > 0 ? D : MAX_D;
  const int64_t d = D > 0 ? D : pb.d;
  const int64_t kvh = head / (pb.hq / pb.hk);
  const int64_t rows = std::min(QB, len - q0);
  const int64_t rows_padded = (rows + RG - 1) / RG * RG;
  alignas(64) float qf[QB][DB];
  alignas(64) float acc[QB][DB];
  alignas(64) float kt[DB][KB];
  alignas(64) float vt[KB][DB];
  alignas(64) float s[QB][KB];
  alignas(64) float kbias[KB];
  float m[QB], l[QB], alpha[QB];
  for (int64_t r = 0; r < rows_padded; ++r) {
    if (r < rows) {
      const scalar_t* src = q.row(start + q0 + r, head);
      for (int64_t c = 0; c < d; ++c) qf[r][c] = static_cast<float>(src[c]) * pb.scale;
    } else {
      for (int64_t c = 0; c < d; ++c) qf[r][c] = 0.f;
    }
    for (int64_t c = 0; c < d; ++c) acc[r][c] = 0.f;
    m[r] = NEG_INF;
    l[r] = 0.f;
  }
  // keys any row of this block may reach
  const int64_t last = q0 + rows - 1;
  const int64_t k_begin = std::max<int64_t>(0, q0 - pb.left);
  int64_t k_end = std::min(len, last + std::min(pb.right, len) + 1);
  if (pb.causal) k_end = std::min(k_end, last + 1);
  for (int64_t kb = k_begin; kb < k_end; kb += KB) {
    const int64_t nk = std::min(KB, k_end - kb);
    for (int64_t j = 0; j < nk; ++j) {
      const scalar_t* ks = k.row(start + kb + j, kvh);
      const scalar_t* vs = v.row(start + kb + j, kvh);
      for (int64_t c = 0; c < d; ++c) kt[c][j] = static_cast<float>(ks[c]);
      for (int64_t c = 0; c < d; ++c) vt[j][c] = static_cast<float>(vs[c]);
      kbias[j] = (pb.key_mask == nullptr || pb.key_mask[start + kb + j]) ? 0.f : NEG_INF;
    }
    for (int64_t j = nk; j < KB; ++j) {
      for (int64_t c = 0; c < d; ++c) kt[c][j] = 0.f;
      kbias[j] = NEG_INF;
    }
    if constexpr (VEC) {
      for (int64_t r0 = 0; r0 < rows_padded; r0 += RG) scores<D>(qf, kt, s, r0);
    } else {
      for (int64_t r = 0; r < rows_padded; ++r) {
        for (int64_t j = 0; j < KB; ++j) s[r][j] = 0.f;
        for (int64_t c = 0; c < d; ++c) {
          const float qc = qf[r][c];
          for (int64_t j = 0; j < KB; ++j) s[r][j] += qc * kt[c][j];
        }
      }
    }
    for (int64_t r = 0; r < rows_padded; ++r) {
      float* sr = s[r];
      const int64_t i = q0 + r;
      // allowed keys of row i within the tile: [lo, hi)
      const int64_t lo = std::max<int64_t>(i - pb.left, kb) - kb;
      const int64_t reach = pb.causal ? i : i + std::min(pb.right, len);
      const int64_t hi = r >= rows ? 0 : std::min<int64_t>(reach, kb + nk - 1) - kb + 1;
      float mx = m[r];
      if (hi > lo) {
        for (int64_t j = 0; j < KB; ++j) sr[j] += kbias[j];
        for (int64_t j = 0; j < lo; ++j) sr[j] = NEG_INF;
        for (int64_t j = hi; j < KB; ++j) sr[j] = NEG_INF;
        vf mv = vload(sr);
        for (int64_t x = 1; x < KB / VW; ++x) { const vf t = vload(sr + x * VW); mv = mv > t ? mv : t; }
        mx = std::max(mx, vmax(mv));
      }
      if (mx == NEG_INF || hi <= lo) {  // no key for this row in this tile (or yet): it keeps its state
        for (int64_t j = 0; j < KB; ++j) sr[j] = 0.f;
        alpha[r] = 1.f;
        continue;
      }
      alpha[r] = std::exp(m[r] - mx);  // exp(-inf) = 0 on the row's first live tile
      vf sv = {};
      for (int64_t x = 0; x < KB / VW; ++x) {
        const vf e = vexp(vload(sr + x * VW) - mx);
        vstore(sr + x * VW, e);
        sv += e;
      }
      const float sum = vsum(sv);
      l[r] = l[r] * alpha[r] + sum;
      m[r] = mx;
    }
    if constexpr (VEC) {
      for (int64_t r0 = 0; r0 < rows_padded; r0 += RG) accumulate<D>(acc, vt, s, alpha, r0, nk);
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        float* o = acc[r];
        for (int64_t c = 0; c < d; ++c) o[c] *= alpha[r];
        for (int64_t j = 0; j < nk; ++j) {
          const float p = s[r][j];
          for (int64_t c = 0; c < d; ++c) o[c] += p * vt[j][c];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = out.row(start + q0 + r, head);
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<scalar_t>(acc[r][c] * inv);
  }
}

template <typename scalar_t, int64_t D>
void run(const Problem& pb, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
         int64_t nseq) {
  std::vector<int64_t> seq_of, q0_of;  // the (sequence, query block) of each task, before the head split
  for (int64_t sidx = 0; sidx < nseq; ++sidx) {
    const int64_t len = pb.cu[sidx + 1] - pb.cu[sidx];
    for (int64_t q0 = 0; q0 < len; q0 += QB) {
      seq_of.push_back(sidx);
      q0_of.push_back(q0);
    }
  }
  const Packed<const scalar_t> qp{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1)};
  const Packed<const scalar_t> kp{k.data_ptr<scalar_t>(), k.stride(0), k.stride(1)};
  const Packed<const scalar_t> vp{v.data_ptr<scalar_t>(), v.stride(0), v.stride(1)};
  const Packed<scalar_t> op{out.data_ptr<scalar_t>(), out.stride(0), out.stride(1)};
  const int64_t blocks = static_cast<int64_t>(seq_of.size());
  at::parallel_for(0, blocks * pb.hq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / pb.hq, head = t % pb.hq;
      const int64_t sidx = seq_of[b];
      const int64_t start = pb.cu[sidx];
      attend_block<scalar_t, D>(pb, qp, kp, vp, op, start, pb.cu[sidx + 1] - start, q0_of[b], head);
    }
  });
}

template <typename scalar_t>
void dispatch_dim(const Problem& pb, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                  int64_t nseq) {
  switch (pb.d) {
    case 32: return run<scalar_t, 32>(pb, q, k, v, out, nseq);
    case 64: return run<scalar_t, 64>(pb, q, k, v, out, nseq);
    case 128: return run<scalar_t, 128>(pb, q, k, v, out, nseq);
    default: return run<scalar_t, 0>(pb, q, k, v, out, nseq);
  }
}

}  // namespace

// q [tokens, hq, d], k/v [tokens, hk, d] (unit stride on d), cu_seqlens int64 [seqs + 1] on CPU, key_mask bool
// [tokens] or None, window (left, right) with -1 for none. Returns a new [tokens, hq, d] tensor of q's dtype.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                            const c10::optional<at::Tensor>& key_mask, bool causal, int64_t left, int64_t right,
                            double scale) {
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
  const bool* km = nullptr;
  if (key_mask.has_value()) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->is_contiguous() && key_mask->numel() == q.size(0),
                "cpu_flash: key_mask must be a contiguous bool [tokens]");
    km = key_mask->data_ptr<bool>();
  }
  constexpr int64_t NONE = std::numeric_limits<int32_t>::max();
  const Problem pb{cu, km, q.size(1), k.size(1), q.size(2), left < 0 ? NONE : left, right < 0 ? NONE : right,
                   causal, static_cast<float>(scale)};
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(pb, q, k, v, out, nseq);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(pb, q, k, v, out, nseq);
  } else {
    TORCH_CHECK(false, "cpu_flash: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("varlen_attention", &varlen_attention, "packed varlen attention (CPU, float32 / bfloat16)");
}
