// e^x's polynomial, shared by WDE's C++ kernels (cpu_flash_attention.cpp, cpu_ops.cpp): Cephes' expf, e^r for the
// remainder r = x - n ln2 in [-ln2/2, ln2/2] as a degree-6 polynomial (~1 ulp); the caller scales by 2^n its own way
// (an exponent-field add, or vscalefps on AVX-512). V: a GCC vector of floats (vector_size(64); __m512 is one).
// Included by the kernels' sources and hashed into their build key (wde/kernels/cpp_build.py).
#pragma once

namespace wde_exp {

constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;  // ln 2 = LN2_HI - LN2_LO, split for an exact n * LN2_HI
constexpr float LN2_LO = 2.12194440e-4f;

// e^r for |r| <= ln2 / 2
template <typename V>
inline V exp_remainder(V r) {
  V p = r * 0.f + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}

// x - n ln2, with n = round(x log2 e) already computed
template <typename V>
inline V exp_reduce(V x, V n) {
  return x - n * LN2_HI + n * LN2_LO;
}

}  // namespace wde_exp
