// One decode query per sequence attending over a KV cache, on a CPU: softmax(q k^T / sqrt(D) + mask) v.
//
// q [B, H, 1, D]; k, v [B, Hkv, S, D] (last dim contiguous; any other strides, e.g. a slice of a
// bigger cache); mask [B, 1, 1, S] bool (True = may attend; broadcast dims may have stride 0).
// Returns [B, H, 1, D] in q's dtype. Arithmetic in float32 whatever the cache's dtype.
//
// Why it exists: PyTorch's CPU attention kernel spends ~170 ns per cached slot per layer on one
// query (9 heads of 64, 2 threads), about ten times the arithmetic. Here each task takes one KV head
// and one run of its allowed slots, reads each key and value row once for all H / Hkv query heads that
// share it (grouped-query attention), and keeps a running softmax (max, sum, weighted values);
// the runs are merged at the end. Runs are what let two threads share three KV heads: each head's allowed
// slots are cut into as many equal runs as make every thread's share the same (Plan).
// Where the CPU has AVX-512 or AVX2 (+ FMA, F16C) and the head size is a multiple of a vector, the chunk
// is computed with explicit vectors (attend_chunk_simd): scores W slots at a time with no horizontal sum per
// slot, the softmax's exponentials W at a time, the weighted values with several heads' accumulators in
// registers, the next rows prefetched. On a 2-core AMD EPYC with AVX2, one layer of SmolLM2 over 1,024 bf16
// slots (30 layers' caches cycled): 111 us with the plain loops, 84 us with the vectors; over 128: 47 and 25.
// With AVX512-BF16, bf16 keys meet the query as bf16 pairs (dot_rows) and bf16 values are widened two halves at
// a time (values_bf16): one layer over 1,088 bf16 slots held in cache, 2 threads, 34.3 -> 26.7 us.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

constexpr int64_t kMaxGroup = 32;   // query heads per KV head (multi-query attention over 32 heads)
constexpr int64_t kMaxDim = 256;    // head_dim
constexpr int64_t kChunk = 256;     // allowed slots per task, at most

struct Partial {  // running softmax of one query head over one chunk
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
  float acc[kMaxDim];  // written whole by the chunk's pass (sum == 0: not read)
};

// 2^f for f in [-0.5, 0.5]: a degree-6 polynomial (relative error ~2e-7), highest power first.
constexpr float kExp2Poly[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
constexpr float kLog2e = 1.44269504088896341f;

// e^x for x <= 0 (softmax weights), in plain arithmetic that the compiler vectorizes: 2^(x log2 e) split into
// an integer power of two (built in the exponent bits) and 2^f by kExp2Poly. Below -87 it returns 0.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * kLog2e;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

// The slots of S that the mask allows, into rows; returns how many.
inline int64_t allowed_slots(const bool* mask, int64_t mask_stride, int64_t S, int64_t* rows) {
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s)
    if (mask[s * mask_stride]) rows[n++] = s;
  return n;
}

// One KV head, the n slots listed in allowed: the G query heads' partial softmax over them, in three passes:
// scores, weights, weighted values. Each key and value row is read once for all G heads.
// kD: the head size when known at compile time (64, 128: the loops over it unroll, 1.4x faster on a 2-core
// EPYC), else 0 and D_ is used.
template <typename T, int64_t kD>
void attend_chunk(const float* qf, const T* k, const T* v, const int64_t* allowed, int64_t n, int64_t k_stride,
                  int64_t v_stride, int64_t G, int64_t D_, float scale, Partial* out) {
  const int64_t D = kD ? kD : D_;
  float row[kMaxDim];
  float scores[kMaxGroup][kChunk];
  if (n == 0) return;  // sum stays 0: the merge skips this chunk
  for (int64_t g = 0; g < G; ++g) std::fill(out[g].acc, out[g].acc + D, 0.f);
  for (int64_t i = 0; i < n; ++i) {  // scores: q . k / sqrt(D)
    const T* krow = k + allowed[i] * k_stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = to_float(krow[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
      scores[g][i] = dot * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // weights: e^(score - max), and their sum
    float m = scores[g][0], sum = 0.f;
    for (int64_t i = 1; i < n; ++i) m = std::max(m, scores[g][i]);
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      scores[g][i] = exp_nonpositive(scores[g][i] - m);
      sum += scores[g][i];
    }
    out[g].max = m;
    out[g].sum = sum;
  }
  for (int64_t i = 0; i < n; ++i) {  // weighted values
    const T* vrow = v + allowed[i] * v_stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = to_float(vrow[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g][i];
      float* acc = out[g].acc;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += w * row[d];
    }
  }
}

// ---- The same chunk with explicit vectors (AVX-512, or AVX2 + FMA + F16C): ~3x faster on a 2-core EPYC ----
// A vector holds W floats. A row of the cache is NB = D / W vectors, converted to float32 as it is loaded.
// Scores: W slots at a time, one query head, one accumulator per slot, then one "sum the lanes of W vectors"
// (a transpose-and-add tree) gives the W scores in one vector: no horizontal sum per slot.
// Weighted values: up to GP query heads at once, their NB-vector accumulators held in registers.
#if defined(__AVX512F__)
#define WORKBOOK_SIMD 1
struct Simd {
  using V = __m512;
  static constexpr int64_t W = 16;
  static constexpr int kRegs = 32;  // vector registers
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {  // bf16 is the top half of a float32
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // 2W bf16 in one load: the even-numbered ones (the low half of each 32-bit lane, shifted up) and the odd-numbered
  // ones (the high half, low bits cleared), each an exact float32: two instructions instead of two widenings.
  static void load_pairs(const c10::BFloat16* p, V& even, V& odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) {  // p * 2^n for whole n: n added to the exponent bits
    __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
  }
  // v[0..15] -> one vector whose lane j is the sum of v[j]'s lanes. Each level halves the vectors and the lanes
  // per slot; the last leaves lane 4k + m holding slot 4m + k, which one permutation puts in place.
  __attribute__((always_inline)) static V sum_lanes(V* v) {
    V a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    V r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WORKBOOK_SIMD 1
struct Simd {
  using V = __m256;
  static constexpr int64_t W = 8;
  static constexpr int kRegs = 16;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void load_pairs(const c10::BFloat16* p, V& even, V& odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) {
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  }
  // v[0..7] -> lane j = sum of v[j]'s lanes; the last level leaves lane 4h + m holding slot 2m + h.
  __attribute__((always_inline)) static V sum_lanes(V* v) {
    V a[4], b[2];
    for (int i = 0; i < 4; ++i)
      a[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                           _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)
      b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    V r = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
};
#endif

#ifdef WORKBOOK_SIMD
// Rows of the cache come from memory (a decode step reads every layer's once): ask for the row kAhead slots on
// while this one is computed, into L1 (hint) for the pass that reads it next.
constexpr int64_t kAhead = 16;
template <typename T>
inline void prefetch_row(const T* row, int64_t D, int hint = _MM_HINT_T0) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < D * static_cast<int64_t>(sizeof(T)); at += 64)
    hint == _MM_HINT_T0 ? _mm_prefetch(p + at, _MM_HINT_T0) : _mm_prefetch(p + at, _MM_HINT_T1);
}

// True where dot_rows reads bf16 keys as bf16 pairs (vdpbf16ps, AVX512-BF16): 32 products a vector, each exact in
// float32 and summed in float32, straight from the cache. The query was bf16 before query_rows widened it, so
// narrowing it back is exact: the same products as the float32 loop, without widening each key.
template <typename T>
constexpr bool kBf16Dot =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// acc[j] = the lanes of q . r[j] (one query head's D floats against W rows of keys; Simd::sum_lanes adds them up).
// Float32 rows are read where they lie; bf16 ones as pairs where kBf16Dot (nb even); other dtypes are widened by
// the caller first (scores_simd).
template <typename T, int64_t NB>
inline void dot_rows(const float* q, const T* const* r, int64_t nb_, typename Simd::V* acc) {
  using S = Simd;
  constexpr int64_t W = S::W;
  const int64_t nb = NB ? NB : nb_;
  for (int64_t j = 0; j < W; ++j) acc[j] = S::zero();
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dot<T>) {
    for (int64_t b = 0; b < nb; b += 2) {
      const __m512bh q2 = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + b * W + W), _mm512_loadu_ps(q + b * W));
      for (int64_t j = 0; j < W; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], q2, reinterpret_cast<__m512bh>(_mm512_loadu_si512(r[j] + b * W)));
    }
    return;
  }
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const typename S::V qb = S::load(q + b * W);
    for (int64_t j = 0; j < W; ++j) acc[j] = S::fma(qb, S::load(r[j] + b * W), acc[j]);
  }
}

// scores[g][i] = q_g . k[rows[i]] * scale for the G query heads and i < n, n a multiple of W (rows padded by the
// caller), W rows at a time. Float32 rows, and bf16 rows where kBf16Dot, are read in place; other rows are widened
// into a float32 block that stays in L1 while every head reads it. The value rows kAhead on are asked for too, into
// L2: the values pass reads them next, and two streams in flight instead of one read the cache ~20% faster (float32,
// 2-core EPYC, 1,088 slots, caches cycled through memory).
template <typename T, int64_t NB>
void scores_simd(const float* qf, int64_t G, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                 const int64_t* rows, int64_t n, int64_t nb_, float scale, float (*scores)[kChunk]) {
  using S = Simd;
  constexpr int64_t W = S::W;
  const int64_t nb = NB ? NB : nb_, D = nb * W;
  const bool in_place = std::is_same_v<T, float> || (kBf16Dot<T> && nb % 2 == 0);
  alignas(64) float block[W][kMaxDim];
  for (int64_t i = 0; i < n; i += W) {
    const T* r[W];
    const float* widened[W];
    for (int64_t j = 0; j < W; ++j) {
      r[j] = k + rows[i + j] * k_stride, widened[j] = block[j];
      if (!in_place)
        for (int64_t b = 0; b < nb; ++b) S::store(block[j] + b * W, S::load(r[j] + b * W));
      if (i + kAhead + j < n) {
        prefetch_row(k + rows[i + kAhead + j] * k_stride, D);
        prefetch_row(v + rows[i + kAhead + j] * v_stride, D, _MM_HINT_T1);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      typename S::V acc[W];
      if (in_place) dot_rows<T, NB>(qf + g * D, r, nb, acc);
      else dot_rows<float, NB>(qf + g * D, widened, nb, acc);
      S::store(scores[g] + i, S::mul(S::sum_lanes(acc), S::set1(scale)));
    }
  }
}

// e^x for x <= 0, W at a time: exp_nonpositive's arithmetic.
inline Simd::V exp_nonpositive(Simd::V x) {
  using S = Simd;
  const S::V t = S::mul(S::max(x, S::set1(-87.f)), S::set1(kLog2e));
  const S::V n = S::round(t);
  const S::V f = S::sub(t, n);
  S::V p = S::set1(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = S::fma(p, f, S::set1(kExp2Poly[i]));
  return S::times_pow2(p, n);
}

// weights[i] = e^(weights[i] - max) for i < padded, zero past n; returns {max, sum} over the first n. The
// padded scores repeat score n - 1, so they do not change the max.
inline std::pair<float, float> softmax_weights(float* weights, int64_t n, int64_t padded) {
  using S = Simd;
  constexpr int64_t W = S::W;
  S::V m = S::load(weights);
  for (int64_t i = W; i < padded; i += W) m = S::max(m, S::load(weights + i));
  alignas(64) float lanes[W];
  S::store(lanes, m);
  const float mx = *std::max_element(lanes, lanes + W);
  for (int64_t i = 0; i < padded; i += W)
    S::store(weights + i, exp_nonpositive(S::sub(S::load(weights + i), S::set1(mx))));
  std::fill(weights + n, weights + padded, 0.f);
  S::V sum = S::zero();
  for (int64_t i = 0; i < padded; i += W) sum = S::add(sum, S::load(weights + i));
  S::store(lanes, sum);
  float total = 0.f;
  for (float x : lanes) total += x;
  return {mx, total};
}

// out[g].acc = sum_i weights[g][i] v[rows[i]] for the GP query heads g0 .. g0 + GP - 1, CB vectors of the row
// at a time: GP x CB accumulators and the CB vectors of one value row stay in registers, and each row is loaded
// and converted once for the GP heads.
template <typename T, int64_t NB, int GP, int CB>
void values_simd(const T* v, int64_t v_stride, const int64_t* rows, int64_t n, int64_t nb_,
                 const float (*weights)[kChunk], int64_t g0, Partial* out) {
  using S = Simd;
  const int64_t nb = NB ? NB : nb_;
  for (int64_t c0 = 0; c0 < nb; c0 += CB) {
    typename S::V acc[GP][CB], x[CB];
    for (int g = 0; g < GP; ++g)
      for (int c = 0; c < CB; ++c) acc[g][c] = S::zero();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = v + rows[i] * v_stride + c0 * S::W;
      if (c0 == 0 && i + kAhead < n) prefetch_row(v + rows[i + kAhead] * v_stride, nb * S::W);
      for (int c = 0; c < CB; ++c) x[c] = S::load(row + c * S::W);
      for (int g = 0; g < GP; ++g) {
        const typename S::V w = S::set1(weights[g0 + g][i]);
        for (int c = 0; c < CB; ++c) acc[g][c] = S::fma(w, x[c], acc[g][c]);
      }
    }
    for (int g = 0; g < GP; ++g)
      for (int c = 0; c < CB; ++c) S::store(out[g0 + g].acc + (c0 + c) * S::W, acc[g][c]);
  }
}

// values_simd for bf16 values: each load of 2W bf16 gives two vectors, the even- and the odd-numbered dims
// (Simd::load_pairs), and the accumulators keep that order until they are stored: CP loads of a row at a time, for
// GP heads, 2 CP accumulators each.
template <int64_t NB, int GP, int CP>
void values_bf16(const c10::BFloat16* v, int64_t v_stride, const int64_t* rows, int64_t n, int64_t nb_,
                 const float (*weights)[kChunk], int64_t g0, Partial* out) {
  using S = Simd;
  constexpr int64_t W = S::W;
  const int64_t pairs = (NB ? NB : nb_) / 2;  // loads of 2W per row
  for (int64_t c0 = 0; c0 < pairs; c0 += CP) {
    typename S::V acc[GP][2 * CP], x[2 * CP];
    for (int g = 0; g < GP; ++g)
      for (int c = 0; c < 2 * CP; ++c) acc[g][c] = S::zero();
    for (int64_t i = 0; i < n; ++i) {
      const c10::BFloat16* row = v + rows[i] * v_stride + c0 * 2 * W;
      if (c0 == 0 && i + kAhead < n) prefetch_row(v + rows[i + kAhead] * v_stride, pairs * 2 * W);
      for (int c = 0; c < CP; ++c) S::load_pairs(row + c * 2 * W, x[2 * c], x[2 * c + 1]);
      for (int g = 0; g < GP; ++g) {
        const typename S::V w = S::set1(weights[g0 + g][i]);
        for (int c = 0; c < 2 * CP; ++c) acc[g][c] = S::fma(w, x[c], acc[g][c]);
      }
    }
    alignas(64) float lanes[2][W];
    for (int g = 0; g < GP; ++g)
      for (int c = 0; c < CP; ++c) {
        S::store(lanes[0], acc[g][2 * c]), S::store(lanes[1], acc[g][2 * c + 1]);
        float* at = out[g0 + g].acc + (c0 + c) * 2 * W;
        for (int64_t l = 0; l < W; ++l) at[2 * l] = lanes[0][l], at[2 * l + 1] = lanes[1][l];
      }
  }
}

// f(std::integral_constant<int, GP>{}, g) for heads g .. g + GP - 1, over all G heads, at most Most at a time.
template <int Most, typename F>
void by_head_groups(int64_t G, const F& f) {
  for (int64_t g = 0; g < G;) {
    const int64_t gp = std::min<int64_t>(Most, G - g);
    switch (gp) {
      case 1: f(std::integral_constant<int, 1>{}, g); break;
      case 2: f(std::integral_constant<int, 2>{}, g); break;
      case 3: f(std::integral_constant<int, 3>{}, g); break;
      default: f(std::integral_constant<int, Most>{}, g);  // Most == 4 here
    }
    g += gp;
  }
}

// values_simd for all G heads, as many at once as the registers hold: GP x CB accumulators and CB row vectors
// in kRegs registers, at most 4 heads (CB = 4 vectors of a row at a time when the row is a multiple of 4
// vectors, else 1; AVX2 with CB = 4 takes 3 heads at once). bf16 rows go to values_bf16, 4 heads at once.
template <typename T, int64_t NB>
void values_all(const T* v, int64_t v_stride, const int64_t* rows, int64_t n, int64_t nb, int64_t G,
                const float (*weights)[kChunk], Partial* out) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && NB % 2 == 0 && NB > 0) {
    // CP loads of 2W per row: 2 (4 vectors) where 4 heads' accumulators and the row fit the registers, else 1
    constexpr int CP = (NB / 2) % 2 == 0 && Simd::kRegs >= 4 * 4 + 4 + 1 ? 2 : 1;
    by_head_groups<4>(G, [&](auto GP, int64_t g) {
      values_bf16<NB, decltype(GP)::value, CP>(v, v_stride, rows, n, nb, weights, g, out);
    });
  } else {
    constexpr int CB = NB && NB % 4 == 0 ? 4 : 1;
    constexpr int kMost = std::min<int>(4, Simd::kRegs / CB - 1);
    static_assert(kMost >= 3, "values_all dispatches 1 to 4 heads at once");
    by_head_groups<kMost>(G, [&](auto GP, int64_t g) {
      values_simd<T, NB, decltype(GP)::value, CB>(v, v_stride, rows, n, nb, weights, g, out);
    });
  }
}

// attend_chunk's contract, with vectors; D must be a multiple of W.
template <typename T, int64_t NB>
void attend_chunk_simd(const float* qf, const T* k, const T* v, const int64_t* allowed, int64_t n,
                       int64_t k_stride, int64_t v_stride, int64_t G, int64_t D, float scale, Partial* out) {
  constexpr int64_t W = Simd::W;
  alignas(64) float weights[kMaxGroup][kChunk];
  int64_t rows[kChunk];
  if (n == 0) return;  // sum stays 0: the merge skips this chunk
  const int64_t padded = (n + W - 1) / W * W, nb = D / W;
  std::copy(allowed, allowed + n, rows);
  for (int64_t i = n; i < padded; ++i) rows[i] = rows[n - 1];  // scores past n are computed, never used
  scores_simd<T, NB>(qf, G, k, k_stride, v, v_stride, rows, padded, nb, scale, weights);
  for (int64_t g = 0; g < G; ++g) std::tie(out[g].max, out[g].sum) = softmax_weights(weights[g], n, padded);
  values_all<T, NB>(v, v_stride, rows, n, nb, G, weights, out);
}
#endif

// The chunk function for head size D: vectors where this CPU has them and D is a multiple of their width,
// with the loops over D unrolled for 64 and 128.
template <typename T>
auto pick_chunk(int64_t D) {
#ifdef WORKBOOK_SIMD
  if (D == 64) return attend_chunk_simd<T, 64 / Simd::W>;
  if (D == 128) return attend_chunk_simd<T, 128 / Simd::W>;
  if (D % Simd::W == 0) return attend_chunk_simd<T, 0>;
#endif
  return D == 64 ? attend_chunk<T, 64> : D == 128 ? attend_chunk<T, 128> : attend_chunk<T, 0>;
}

// The G query heads of KV head h in sequence b, as float32 rows of D.
template <typename T>
void query_rows(const at::Tensor& q, int64_t b, int64_t h, int64_t G, float* rows) {
  const int64_t D = q.size(3);
  const T* p = q.data_ptr<T>() + b * q.stride(0) + h * G * q.stride(1);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) rows[g * D + d] = to_float(p[g * q.stride(1) + d * q.stride(3)]);
}

// out[b, h * G + g] = the chunks' partial softmaxes of that query head merged: sum_c e^(max_c - max) acc_c over
// sum_c e^(max_c - max) sum_c. A head whose every chunk allowed no slot gets zeros (SDPA gives NaN).
template <typename T>
void merge_chunks(const Partial* first, int64_t chunks, int64_t stride, int64_t D, T* out) {
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f, o[kMaxDim] = {0.f};
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, first[c * stride].max);
  for (int64_t c = 0; c < chunks; ++c) {
    const Partial& p = first[c * stride];
    if (p.sum == 0.f) continue;
    const float w = std::exp(p.max - m);
    sum += p.sum * w;
    for (int64_t d = 0; d < D; ++d) o[d] += p.acc[d] * w;
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(o[d] * inv);
}

// Which cached rows each task reads. A task is one KV head of one sequence and one run of that sequence's allowed
// slots; each head's allowed slots are cut into `chunks` runs of equal length (to within one), at most kChunk long,
// and `chunks` is the smallest for which the B * Hkv * chunks tasks split evenly over the threads: every thread
// then reads the same number of rows. (Runs of kChunk slots each, 3 KV heads on 2 threads, gave one thread twice
// the rows of the other at 128 tokens of context.)
struct Plan {
  std::vector<int64_t> rows;   // [B, S]: sequence b's allowed slots first, in order
  std::vector<int64_t> count;  // [B]: how many
  int64_t chunks = 1;
  // Task t's first row and row count.
  std::pair<const int64_t*, int64_t> task_rows(int64_t b, int64_t c, int64_t S) const {
    const int64_t n = count[b], begin = c * n / chunks, end = (c + 1) * n / chunks;
    return {rows.data() + b * S + begin, end - begin};
  }
};

Plan plan_tasks(const bool* mask, int64_t mask_b, int64_t mask_s, int64_t B, int64_t Hkv, int64_t S) {
  Plan plan;
  plan.rows.resize(B * S);
  plan.count.resize(B);
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) {
    plan.count[b] = allowed_slots(mask + b * mask_b, mask_s, S, plan.rows.data() + b * S);
    most = std::max(most, plan.count[b]);
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  plan.chunks = std::max<int64_t>(1, (most + kChunk - 1) / kChunk);
  while ((B * Hkv * plan.chunks) % threads != 0) ++plan.chunks;  // at most threads - 1 more
  return plan;
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& mask, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  const int64_t G = H / Hkv;
  const int64_t mask_b = mask.size(0) == 1 ? 0 : mask.stride(0), mask_s = mask.size(3) == 1 ? 0 : mask.stride(3);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const Plan plan = plan_tasks(mask.data_ptr<bool>(), mask_b, mask_s, B, Hkv, S);
  const int64_t C = plan.chunks;
  const auto attend = pick_chunk<T>(D);
  std::unique_ptr<Partial[]> parts(new Partial[B * Hkv * C * G]);  // acc left unset: each chunk writes it
  at::parallel_for(0, B * Hkv * C, 1, [&](int64_t first, int64_t last) {
    float qt[kMaxGroup * kMaxDim];
    int64_t qt_head = -1;  // the (b, h) whose query rows qt holds: a thread's tasks run through its chunks in order
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / (Hkv * C), h = (task / C) % Hkv, c = task % C;
      if (task / C != qt_head) query_rows<T>(q, b, h, G, qt), qt_head = task / C;
      const T* kt = kp + b * k.stride(0) + h * k.stride(1);
      const T* vt = vp + b * v.stride(0) + h * v.stride(1);
      const auto [rows, n] = plan.task_rows(b, c, S);
      attend(qt, kt, vt, rows, n, k.stride(2), v.stride(2), G, D, scale, &parts[task * G]);
    }
  });
  T* op = out.data_ptr<T>();  // [B, H, 1, D], contiguous
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g)
        merge_chunks<T>(&parts[((b * Hkv + h) * C) * G + g], C, G, D, op + (b * H + h * G + g) * D);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be [B, H, 1, D]");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "decode_attention: k, v must be [B, Hkv, S, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) <= kMaxGroup,
              "decode_attention: H must be a multiple of Hkv, at most ", kMaxGroup, " times");
  TORCH_CHECK(q.size(3) == k.size(3) && q.size(3) <= kMaxDim, "decode_attention: head_dim up to ", kMaxDim);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k, v need a contiguous last dim");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention: q, k, v must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "decode_attention: float32, bf16 or fp16 only (it computes in float32), got ", q.scalar_type());
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(3) == k.size(2),
              "decode_attention: mask must be bool [B, 1, 1, S]");
  TORCH_CHECK(k.size(0) == q.size(0) && (mask.size(0) == 1 || mask.size(0) == q.size(0)),
              "decode_attention: k, v and mask must have q's batch size (the mask may have 1)");
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  auto impl = [&](auto zero) { decode_attention_impl<decltype(zero)>(q, k, v, mask, out); };
  if (q.scalar_type() == at::kFloat) impl(0.f);
  else if (q.scalar_type() == at::kBFloat16) impl(c10::BFloat16{});
  else impl(c10::Half{});
  return out;
}

}  // namespace

TORCH_LIBRARY(workbook, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbook, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
