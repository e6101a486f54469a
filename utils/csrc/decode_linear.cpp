// Matrix products for decode's few rows on a CPU, y = x W^T: float32 or bf16 weights, and weight-only int8 and int4.
//
// float_linear(x [M, K], w float32 or bf16 [N, K], or [P, N / P, K] laid out by thread) -> [M, N] in x's dtype.
// int8_linear(x [M, K], q int8 [N, K], scale float32 [N]) -> [M, N] in x's dtype: W = q * scale (per row).
// int4_linear(x [M, K], packed uint8 [N, K / 2], dm float16 [N, K / g, 2], g) -> [M, N] in x's dtype:
//   W[n, k] = q * d + m, (d, m) = dm[n, k / g]; q in [0, 15]. Each block of 32 weights k0 .. k0 + 31 of a row is
//   16 bytes, byte j = q[k0 + j] | q[k0 + 16 + j] << 4 (GGUF's Q4_1 order: one AND and one shift split a block
//   into its two halves). g is a multiple of 32.
// q, packed and dm may be laid out by thread too ([P, N / P, K], [P, N / P, K / 2], [P, N / P, K / g, 2]; see
// float_linear); the sums are those of the [N, K] layout.
// x may be float32, bf16 or fp16; the arithmetic is float32: each weight is rebuilt as a float (q * d + m in one
// FMA) and multiplied by x's float32 row, so the result differs from x @ W^T in float32 only by summation order.
//
// Why it exists: a decode step multiplies one row by every weight matrix, so its time is the weights' bytes over
// the memory bandwidth, if the kernel keeps up with the memory. For float weights PyTorch's own kernels keep up,
// but a compiled step must then pre-pack them at compile time (half a minute per step); on these kernels a step
// has nothing to pack and is built from small parts in seconds (utils/fast.py, LayeredStep). PyTorch's
// weight-only kernels on a 2-core AMD EPYC (AVX2) read int8 at 8.5 GB/s and int4 at 6.8 GB/s against a probe's 20.
// Here each thread takes a range of output rows and streams them once, for up to four rows of x at a time, with
// independent accumulators so that no FMA waits on the previous one.
#include <atomic>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define WORKBOOK_SIMD 1
#endif

namespace {

constexpr int64_t kBlock = 32;   // int4 weights per 16-byte block
constexpr int64_t kMaxRows = 4;  // rows of x sharing one pass over the weights
constexpr int64_t kGrain = 16;   // output rows per task, at least

// x's rows as float32 (the kernels read them once per weight block, from L1): x itself when it is float32 and
// contiguous, else converted or copied (a float32 slice of a wider x) into ``buffer``. No new tensor: a decode step
// makes ~200 of these calls, and two tensor conversions per call cost as much as reading a small matrix.
const float* float_rows(const at::Tensor& x, std::vector<float>& buffer) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  buffer.resize(xc.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "float_rows", [&] {
    const scalar_t* p = xc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < xc.numel(); ++i) buffer[i] = static_cast<float>(p[i]);
  });
  return buffer.data();
}

// The output [M, N] in x's dtype, and where the kernels write its float32 values: into it for float32, else into
// ``buffer``, which finish() rounds into it.
struct Output {
  at::Tensor y;
  float* values;
};

Output new_output(const at::Tensor& x, int64_t N, std::vector<float>& buffer) {
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (y.scalar_type() == at::kFloat) return {y, y.data_ptr<float>()};
  buffer.resize(y.numel());
  return {y, buffer.data()};
}

at::Tensor finish(const Output& out) {
  if (out.y.scalar_type() != at::kFloat)
    AT_DISPATCH_REDUCED_FLOATING_TYPES(out.y.scalar_type(), "finish", [&] {
      scalar_t* p = out.y.data_ptr<scalar_t>();
      for (int64_t i = 0; i < out.y.numel(); ++i) p[i] = static_cast<scalar_t>(out.values[i]);
    });
  return out.y;
}

thread_local std::vector<float> x_buffer, y_buffer, pair_buffer;  // the calling thread's, reused call after call

// Asks for the cache lines ``kPrefetchBytes`` past the ``bytes`` bytes at ``p`` to be brought into L2. A thread
// streams its rows in order, so those are lines it reads soon (past its last row, a harmless read). The hardware's
// own prefetcher stops at each 4 KiB page and keeps fewer lines in flight. Measured on a 2-core Xeon (AMX), the
// projections alone of SmolLM2's shapes, in turns: int8 9.9 -> 11.9 GB/s and int4 8.4 -> 10.2 at 2 KiB ahead
// (4-16 KiB: less). The float kernel, four weight rows at a time, is faster without it there (float_block); on
// an AMD EPYC one float row at a time with it is faster (float_linear).
constexpr int64_t kPrefetchBytes = 2048;
inline void prefetch_l2(const void* p, int64_t bytes) {
#ifdef WORKBOOK_SIMD
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes + b, _MM_HINT_T1);
#endif
}


// A weight laid out by thread is one stream per thread through a decode step (see float_linear). Each row of it
// asks for the bytes stream_ahead_bytes on (default 8 KiB, about seven bf16 rows of SmolLM2) with PREFETCHNTA, a
// hint that the line is used once: the stream runs further ahead than the CPU's own prefetcher takes it, and the
// weights passing through keep less of the caches from what is read again (the KV cache, the activations). Measured
// on a 2-core AMD EPYC (AVX-512), SmolLM2's compiled steps with and without it in turns in one process (9-11 rounds,
// medians), tokens equal. bf16 at 1,024 tokens, three runs: 107.6 -> 118.1 tok/s (4 KiB ahead), 105.4 -> 114.4
// (8 KiB; 4 KiB 109.0, 16 KiB 112.6), 104.6 -> 115.7 (8 KiB; as a plain L2 prefetch at that distance: 110.8); at
// 128 tokens 120.5 -> 125.5 (4 KiB), 112.9 -> 130.2 and 114.8 -> 129.5 (8 KiB). At 8 KiB, one run of all four:
// bf16 1.045x at 128 and 1.147x at 1,024, int4 1.236x / 1.121x, float32 1.034x / 1.034x, int8 1.018x / 1.036x.
// Asking 2 KiB ahead into L2 had been slower than not asking (see float_linear). set_stream_ahead changes the
// distance (0: none) for such comparisons.
std::atomic<int64_t> stream_ahead_bytes{8192};

inline void stream_ahead(const void* row, int64_t bytes) {
#ifdef WORKBOOK_SIMD
  const int64_t ahead = stream_ahead_bytes.load(std::memory_order_relaxed);
  if (ahead == 0) return;
  const char* p = static_cast<const char*>(row) + ahead;  // past the buffer's end: a harmless request
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_NTA);
#endif
}

int64_t set_stream_ahead(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes % 64 == 0, "set_stream_ahead: bytes must be a multiple of 64 and >= 0, got ", bytes);
  return stream_ahead_bytes.exchange(bytes);
}

#ifdef WORKBOOK_SIMD
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One int8 weight row against MR rows of x: four accumulators per x row, 32 weights per pass (64 with AVX-512).
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int MR>
void int8_row(const float* x, int64_t K, const int8_t* w, float scale, float* y, int64_t N, bool ahead = true) {
  if (ahead) prefetch_l2(w, K);
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512 f[4];
    for (int j = 0; j < 4; ++j)
      f[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16 * j))));
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(f[j], _mm512_loadu_ps(x + m * K + k + 16 * j), acc[m][j]);
  }
  for (int m = 0; m < MR; ++m) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
    for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[t]) * x[m * K + t];
    y[m * N] = sum * scale;
  }
}
#else
template <int MR>
void int8_row(const float* x, int64_t K, const int8_t* w, float scale, float* y, int64_t N, bool ahead = true) {
  if (ahead) prefetch_l2(w, K);
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256 f[4];
    for (int j = 0; j < 4; ++j)
      f[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8 * j))));
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_fmadd_ps(f[j], _mm256_loadu_ps(x + m * K + k + 8 * j), acc[m][j]);
  }
  for (int m = 0; m < MR; ++m) {
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
    for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[t]) * x[m * K + t];
    y[m * N] = sum * scale;
  }
}
#endif

// The group of block b: b itself for groups of 32 (the default), without a division (tens of cycles, per block).
inline int64_t group_of(int64_t b, int64_t g) { return g == kBlock ? b : b * kBlock / g; }

// x's rows prepared for the int4 kernel: per 32-value block b, int16 values x16 = round(x / dx_b) with
// dx_b = max|x_b| / 32767 (relative error 1.5e-5: the product stays a weight-only one), and the block's exact sum.
struct Int16Rows {
  std::vector<int16_t> x16;   // [M, K]; with AVX-512, each pair of blocks in halves (pair_halves)
  std::vector<float> scale;   // [M, K / 32]: dx_b
  std::vector<float> sum;     // [M, K / 32]: sum of x over the block, float32
};

// One block of 32 floats -> 32 int16 (round to nearest) with its scale and exact sum, in AVX2.
inline void int16_block(const float* xb, int16_t* out, float* scale, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    total = _mm256_add_ps(total, v[j]);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float big = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float dx = big / 32767.f;
  const __m256 inv = _mm256_set1_ps(big > 0.f ? 1.f / dx : 0.f);
  for (int j = 0; j < 4; j += 2) {  // packs interleaves 128-bit lanes: the permute puts them back in order
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)),
                                              _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * j), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  *scale = dx, *sum = hsum(total);
}

// Blocks b and b + 1 (b even) of a row of x16 side by side in halves, as the AVX-512 kernel reads a pair of weight
// blocks: [x_b 0..15, x_b+1 0..15, x_b 16..31, x_b+1 16..31]. A last block without a partner stays as it is.
inline void pair_halves(int16_t* row, int64_t nb) {
  int16_t both[2 * kBlock];
  for (int64_t b = 0; b + 1 < nb; b += 2) {
    int16_t* p = row + b * kBlock;
    std::memcpy(both, p, sizeof both);
    std::memcpy(p + 16, both + 32, 16 * sizeof(int16_t));
    std::memcpy(p + 32, both + 16, 16 * sizeof(int16_t));
  }
}

const Int16Rows& int16_rows(const float* x, int64_t M, int64_t K) {
  thread_local Int16Rows r;  // the calling thread's, reused call after call
  r.x16.resize(M * K), r.scale.resize(M * K / kBlock), r.sum.resize(M * K / kBlock);
  for (int64_t b = 0; b < M * K / kBlock; ++b)
    int16_block(x + b * kBlock, r.x16.data() + b * kBlock, &r.scale[b], &r.sum[b]);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t m = 0; m < M; ++m) pair_halves(r.x16.data() + m * K, K / kBlock);
#endif
  return r;
}

// One int4 weight row against MR rows of x: y = sum_b d_b dx_b (q_b . x16_b) + m_b sum(x_b). A block's 32 weights
// widen to int16 (two vectors of 16) and meet x16 in two multiply-adds (int32 pairs), one float FMA per block.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// With AVX-512 two blocks' 64 weights are two vectors of int16 (one 32-byte load, an AND and a shift): two
// multiply-adds per row of x (one with AVX512-VNNI's vpdpwssd adding in place), one conversion and one FMA for both
// blocks, their two scales put side by side by one permute. The blocks' scales go 16 at a time: d_b * dx_b for
// each row of x in one multiply, the offsets' sum m_b * sum(x_b) in one FMA. Against one block at a time (one
// 16-byte load widened, a multiply-add, a conversion and an FMA per block), 2-core AMD EPYC: SmolLM2's int4
// projections alone, laid out by thread, 13.2 -> 16.0 GB/s (40 rounds in turns); one 1,536 x 576 matrix in cache,
// 1 thread, 74.3 -> 58.0 us; the compiled int4 step at 128 tokens 121.8 -> 138.1 tok/s (20 paired rounds, 1.116).
constexpr int64_t kChunk = 16;  // blocks whose scales are prepared together

template <int MR>
void int4_row(const Int16Rows& xr, int64_t K, const uint8_t* w, const uint16_t* dm, int64_t g, float* y,
              int64_t N, int64_t m0, bool ahead = true) {
  const int64_t nb = K / kBlock;
  if (ahead) prefetch_l2(w, K / 2), prefetch_l2(dm, 4 * (K / g));
  __m512 acc[MR][2], offsets[MR];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = offsets[m] = _mm512_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i halves_of_pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  alignas(64) float d[kChunk], mv[kChunk], scale[MR][kChunk];
  for (int64_t c = 0; c < nb; c += kChunk) {
    const int64_t nc = std::min(kChunk, nb - c);
    const __mmask16 live = static_cast<__mmask16>((1u << nc) - 1);
    if (g == kBlock) {  // one (d, m) pair per block: 16 pairs in two loads, split into d's and m's
      const __mmask32 pairs = static_cast<__mmask32>((1ull << (2 * nc)) - 1);
      const __m512i halves = _mm512_maskz_loadu_epi16(pairs, dm + 2 * c);
      const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));        // d0 m0 .. d7 m7
      const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));  // d8 m8 .. d15 m15
      const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      _mm512_store_ps(d, _mm512_permutex2var_ps(lo, evens, hi));
      _mm512_store_ps(mv, _mm512_permutex2var_ps(lo, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), hi));
    } else {
      for (int64_t j = 0; j < kChunk; ++j) {
        const uint16_t* pair = dm + 2 * group_of(c + std::min(j, nc - 1), g);
        d[j] = _cvtsh_ss(pair[0]), mv[j] = _cvtsh_ss(pair[1]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * nb + c;
      _mm512_store_ps(scale[m], _mm512_mul_ps(_mm512_load_ps(d), _mm512_maskz_loadu_ps(live, xr.scale.data() + at)));
      offsets[m] = _mm512_fmadd_ps(_mm512_load_ps(mv), _mm512_maskz_loadu_ps(live, xr.sum.data() + at), offsets[m]);
    }
    // blocks j and j + 1 go to two accumulators (two FMA chains); the block's 16 bytes fill both halves of a
    // vector, low nibbles taken from the first half and high ones from the second
    auto block = [&](int64_t j, int chain) {
      const int64_t b = c + j;
      const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16)));
      const __m512i q = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srlv_epi32(both, shifts), low4));
      for (int m = 0; m < MR; ++m) {
        const __m512i p = _mm512_madd_epi16(q, _mm512_loadu_si512(xr.x16.data() + ((m0 + m) * nb + b) * kBlock));
        acc[m][chain] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(scale[m][j]), acc[m][chain]);
      }
    };
    // blocks j and j + 1 together: their 32 bytes hold both blocks' low nibbles (first 16 weights of each) and
    // high nibbles; widened to int16 they meet x16 laid out in pairs (pair_halves), so that int32 lanes 0-7 sum
    // block j and lanes 8-15 block j + 1, and one FMA applies both blocks' scales
    auto pair = [&](int64_t j, int chain) {
      const int64_t b = c + j;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 16));
      const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(bytes, low4));
      const __m512i hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
      const __m512i which = _mm512_add_epi32(halves_of_pair, _mm512_set1_epi32(static_cast<int>(j)));
      for (int m = 0; m < MR; ++m) {
        const int16_t* xb = xr.x16.data() + ((m0 + m) * nb + b) * kBlock;
#ifdef __AVX512VNNI__
        const __m512i p =
            _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, _mm512_loadu_si512(xb)), hi, _mm512_loadu_si512(xb + 32));
#else
        const __m512i p = _mm512_add_epi32(_mm512_madd_epi16(lo, _mm512_loadu_si512(xb)),
                                           _mm512_madd_epi16(hi, _mm512_loadu_si512(xb + 32)));
#endif
        const __m512 both_scales = _mm512_permutexvar_ps(which, _mm512_load_ps(scale[m]));
        acc[m][chain] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), both_scales, acc[m][chain]);
      }
    };
    int64_t j = 0;
    for (; j + 4 <= nc; j += 4) pair(j, 0), pair(j + 2, 1);
    if (j + 2 <= nc) pair(j, 0), j += 2;
    if (j < nc) block(j, 0);  // a last block without a partner (an odd number of blocks in the row)
  }
  for (int m = 0; m < MR; ++m)
    y[m * N] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), offsets[m]));
}
#else
template <int MR>
void int4_row(const Int16Rows& xr, int64_t K, const uint8_t* w, const uint16_t* dm, int64_t g, float* y,
              int64_t N, int64_t m0, bool ahead = true) {
  const int64_t nb = K / kBlock;
  if (ahead) prefetch_l2(w, K / 2), prefetch_l2(dm, 4 * (K / g));
  __m256 acc[MR][2];
  float msum[MR][2] = {};
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  auto block = [&](int64_t b, int c) {  // two accumulators, as above
    const uint16_t* pair = dm + 2 * group_of(b, g);
    const float d = _cvtsh_ss(pair[0]), mv = _cvtsh_ss(pair[1]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low4));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    for (int m = 0; m < MR; ++m) {
      const int16_t* xb = xr.x16.data() + (m0 + m) * K + b * kBlock;
      const __m256i p = _mm256_add_epi32(
          _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
      const int64_t at = (m0 + m) * nb + b;
      acc[m][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xr.scale[at]), acc[m][c]);
      msum[m][c] += mv * xr.sum[at];
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) block(b, 0), block(b + 1, 1);
  if (b < nb) block(b, 0);
  for (int m = 0; m < MR; ++m) y[m * N] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + msum[m][0] + msum[m][1];
}
#endif
#else
template <int MR>
void int8_row(const float* x, int64_t K, const int8_t* w, float scale, float* y, int64_t N, bool = true) {
  for (int m = 0; m < MR; ++m) {
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(w[k]) * x[m * K + k];
    y[m * N] = sum * scale;
  }
}

template <int MR>
void int4_row(const float* x, int64_t K, const uint8_t* w, const at::Half* dm, int64_t g, float* y, int64_t N) {
  for (int m = 0; m < MR; ++m) {
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t j = k % kBlock, byte = (k - j) / 2 + j % 16;
      const int q = j < 16 ? (w[byte] & 0x0F) : (w[byte] >> 4);
      const at::Half* pair = dm + 2 * (k / g);
      sum += (q * static_cast<float>(pair[0]) + static_cast<float>(pair[1])) * x[m * K + k];
    }
    y[m * N] = sum;
  }
}
#endif

// R float32 weight rows (w, w + K, ...) against MR rows of x: y[m * N + r]. One accumulator per pair, a vector of K
// per step: each x vector is loaded once for R weight rows, and R streams of weights are in flight. Only the
// summation order differs from x @ W^T in float32. Measured on a 2-core Xeon, SmolLM2's projections alone, in turns:
// 4 weight rows at a time 21.9-22.5 GB/s, 2 rows 20.5-21.9, one row 18.1-18.5 (PyTorch's 20.7-22.4), a software
// prefetch made 2 and 4 rows slower. Without vectors it also takes bf16 weights (W = uint16_t, their bits: a 16-bit
// shift makes each an exact float32); with them bf16 has its own kernel, bf16_row below.
#if defined(WORKBOOK_SIMD) && defined(__AVX512F__) && defined(__AVX512BW__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vec_zero() { return _mm512_setzero_ps(); }
inline Vec vec_load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vec_fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vec_add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vec_sum(Vec a) { return _mm512_reduce_add_ps(a); }
constexpr int kFloatWeightRows = 4;
#elif defined(WORKBOOK_SIMD)
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vec_zero() { return _mm256_setzero_ps(); }
inline Vec vec_load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vec_fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vec_add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vec_sum(Vec a) { return hsum(a); }
constexpr int kFloatWeightRows = 2;  // 16 vector registers: 4 rows of x x 2 weight rows of accumulators, their loads
#else
constexpr int kFloatWeightRows = 1;
#endif

inline float scalar_weight(float w) { return w; }
inline float scalar_weight(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <int MR, int R, typename W>
void float_block(const float* x, int64_t K, const W* w, float* y, int64_t N) {
  int64_t k = 0;
  float sum[MR][R] = {};
#ifdef WORKBOOK_SIMD
  constexpr int C = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // independent sums per pair: at most 16 accumulators
  Vec acc[MR][R][C];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[m][r][c] = vec_zero();
  for (; k + C * kLanes <= K; k += C * kLanes)
    for (int c = 0; c < C; ++c) {
      Vec xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = vec_load(x + m * K + k + c * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec f = vec_load(w + r * K + k + c * kLanes);
        for (int m = 0; m < MR; ++m) acc[m][r][c] = vec_fma(f, xv[m], acc[m][r][c]);
      }
    }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) {
      for (int c = 1; c < C; ++c) acc[m][r][0] = vec_add(acc[m][r][0], acc[m][r][c]);
      sum[m][r] = vec_sum(acc[m][r][0]);  // one horizontal sum per pair
    }
#endif
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) {
      for (int64_t t = k; t < K; ++t) sum[m][r] += scalar_weight(w[r * K + t]) * x[m * K + t];
      y[m * N + r] = sum[m][r];
    }
}

// ---- bf16 weights: each 32-bit lane of a vector load holds two weights, an even-indexed one in its low half and
// the next in its high half. A 16-bit shift left makes the even one a float32, an AND with 0xFFFF0000 the odd one:
// two plain integer operations for 2 x kLanes weights, where widening each half (vpmovzxwd, one shuffle port)
// took two shuffles and two shifts. x is laid out to match once per call (pair_rows): in each block of 2 x kLanes
// values, the even-indexed ones, then the odd. Each product is still exact; the sums run in another order.
#ifdef WORKBOOK_SIMD
#if defined(__AVX512F__) && defined(__AVX512BW__)
using IVec = __m512i;
inline IVec ivec_load(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline Vec even_weights(IVec w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline Vec odd_weights(IVec w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))); }
#else
using IVec = __m256i;
inline IVec ivec_load(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vec even_weights(IVec w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline Vec odd_weights(IVec w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536))); }
#endif
constexpr int64_t kPair = 2 * kLanes;  // bf16 weights per vector load

// x [M, K] in pair order (see above) into buffer; values past the last whole block are left in place.
const float* pair_rows(const float* x, int64_t M, int64_t K, std::vector<float>& buffer) {
  buffer.resize(M * K);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float* out = buffer.data() + m * K;
    int64_t k = 0;
    for (; k + kPair <= K; k += kPair)
      for (int64_t j = 0; j < kLanes; ++j) out[k + j] = xm[k + 2 * j], out[k + kLanes + j] = xm[k + 2 * j + 1];
    std::copy(xm + k, xm + K, out + k);
  }
  return buffer.data();
}

// One bf16 weight row against MR rows of x (xp: x in pair order), as float_block: y[m * N]. With ahead, the row
// 2 KiB ahead is asked for first (prefetch_l2; not for a weight laid out by thread, see float_linear). Measured on
// a 2-core Xeon, SmolLM2's projections alone (30 layers cycled), in turns with the widening loads of float_block:
// AVX2 build 9.6-10.6 -> 12.0-13.1 GB/s (four rounds), AVX-512 build 11.3-12.0 -> 13.0-14.8 (three); two or four
// weight rows at a time, or no prefetch, were slower.
template <int MR>
void bf16_row(const float* xp, int64_t K, const uint16_t* w, float* y, int64_t N, bool ahead = true) {
  if (ahead) prefetch_l2(w, 2 * K);
  constexpr int C = MR <= 2 ? 2 : 1;  // vector loads per pass: at least 4 independent sums per row of x
  Vec acc[MR][2 * C];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 2 * C; ++c) acc[m][c] = vec_zero();
  auto block = [&](int64_t at, int c) {  // the kPair weights from at into accumulators 2c (even) and 2c + 1 (odd)
    const IVec wv = ivec_load(w + at);
    const Vec even = even_weights(wv), odd = odd_weights(wv);
    for (int m = 0; m < MR; ++m) {
      acc[m][2 * c] = vec_fma(even, vec_load(xp + m * K + at), acc[m][2 * c]);
      acc[m][2 * c + 1] = vec_fma(odd, vec_load(xp + m * K + at + kLanes), acc[m][2 * c + 1]);
    }
  };
  int64_t k = 0;
  for (; k + C * kPair <= K; k += C * kPair)
    for (int c = 0; c < C; ++c) block(k + c * kPair, c);
  for (; k + kPair <= K; k += kPair) block(k, 0);  // a last whole block when C = 2
  for (int m = 0; m < MR; ++m) {
    for (int c = 1; c < 2 * C; ++c) acc[m][0] = vec_add(acc[m][0], acc[m][c]);
    float sum = vec_sum(acc[m][0]);
    for (int64_t t = k; t < K; ++t) sum += scalar_weight(w[t]) * xp[m * K + t];  // the tail, left in place
    y[m * N] = sum;
  }
}
#endif

// Calls row(n, m0, mr, R) for every block of R output rows from n (R a compile-time constant: the thread's last
// rows come one at a time) and every block of up to kMaxRows rows of x from m0 (mr of them); output rows split
// across threads. R > 1 lets a kernel load each x vector once for R weight rows. With parts > 1 the N rows are
// that many equal parts (a weight laid out by thread, see float_linear) and the threads split the parts, not the
// rows: with as many parts as threads, thread t takes part t, and no block of R rows crosses a part's end.
template <int R = 1, typename Row>
void for_each_row(int64_t M, int64_t N, const Row& row, int64_t parts = 1) {
  auto rows = [&](int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mr = std::min(kMaxRows, M - m0);
      int64_t n = first;
      if constexpr (R > 1)
        for (; n + R <= last; n += R) row(n, m0, mr, std::integral_constant<int, R>{});
      for (; n < last; ++n) row(n, m0, mr, std::integral_constant<int, 1>{});
    }
  };
  if (parts == 1) return at::parallel_for(0, N, kGrain, rows);
  const int64_t per_part = N / parts;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) rows(p * per_part, (p + 1) * per_part);
  });
}

template <typename F>
void dispatch_rows(int64_t mr, const F& f) {
  switch (mr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, ": x must be float32, bf16 or fp16");
}

// Where the N rows of a weight lie: [N, row...] contiguous, or laid out by thread (see float_linear): [P, N / P,
// row...] with contiguous rows and any stride between the P parts. Row n is row n % (N / P) of part n / (N / P).
struct WeightRows {
  bool valid = false, parted = false;
  int64_t P = 1, N = 0, per_part = 1, part_stride = 0, row = 1;  // row: elements per row
  template <typename T>
  T* at(T* base, int64_t n) const {  // no division for a plain weight
    return parted ? base + n / per_part * part_stride + n % per_part * row : base + n * row;
  }
};

// w's rows, each of row_dims dimensions (1 for [.., K], 2 for int4's dm [.., K / g, 2]); valid = false for any
// other shape or layout.
WeightRows weight_rows(const at::Tensor& w, int64_t row_dims) {
  WeightRows r;
  if (w.dim() != row_dims + 1 && w.dim() != row_dims + 2) return r;
  r.parted = w.dim() == row_dims + 2;
  int64_t expected = 1;  // contiguous rows: back from the last dimension, each stride the sizes after it multiplied
  for (int64_t d = w.dim() - 1; d >= (r.parted ? 1 : 0); --d) {
    r.valid = w.stride(d) == expected || w.size(d) == 1;
    if (!r.valid) return r;
    if (d >= w.dim() - row_dims) r.row *= w.size(d);
    expected *= w.size(d);
  }
  r.P = r.parted ? w.size(0) : 1;
  r.N = r.parted ? r.P * w.size(1) : w.size(0);
  if (r.parted) r.per_part = std::max<int64_t>(1, w.size(1)), r.part_stride = w.stride(0);
  return r;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const WeightRows qr = weight_rows(q, 1);
  TORCH_CHECK(qr.valid && q.scalar_type() == at::kChar,
              "int8_linear: q must be int8 [N, K] contiguous, or [P, N / P, K] with contiguous rows");
  const int64_t K = q.size(-1), N = qr.N;
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat,
              "int8_linear: scale must be float32 [N]");
  check_x(x, K, "int8_linear");
  const int64_t M = x.size(0);
  const at::Tensor sc = scale.contiguous();
  const Output out = new_output(x, N, y_buffer);
  const float *xp = float_rows(x, x_buffer), *sp = sc.data_ptr<float>();
  const int8_t* wp = q.data_ptr<int8_t>();
  float* yp = out.values;
  for_each_row(M, N, [&](int64_t n, int64_t m0, int64_t mr, auto) {
    if (qr.parted && m0 == 0) stream_ahead(qr.at(wp, n), K);
    dispatch_rows(mr, [&](auto MR) {
      int8_row<MR.value>(xp + m0 * K, K, qr.at(wp, n), sp[n], yp + m0 * N + n, N, !qr.parted);
    });
  }, qr.P);
  return finish(out);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, int64_t g) {
  TORCH_CHECK(g > 0 && g % kBlock == 0, "int4_linear: the group size must be a multiple of ", kBlock, ", got ", g);
  const WeightRows wr = weight_rows(packed, 1), dr = weight_rows(dm, 2);
  TORCH_CHECK(wr.valid && packed.scalar_type() == at::kByte && (2 * packed.size(-1)) % g == 0,
              "int4_linear: packed must be uint8 [N, K / 2] (or [P, N / P, K / 2] with dm [P, N / P, K / g, 2]), K a "
              "multiple of ", g);
  const int64_t M = x.size(0), K = 2 * packed.size(-1), N = wr.N;
  TORCH_CHECK(dr.valid && dr.parted == wr.parted && dr.P == wr.P && dr.N == N && dm.scalar_type() == at::kHalf &&
              dm.size(-1) == 2 && dm.size(-2) == K / g,
              "int4_linear: dm must be float16 [N, K / g, 2], or dm [P, N / P, K / g, 2] beside packed laid out by ",
              "thread");
  check_x(x, K, "int4_linear");
  const Output out = new_output(x, N, y_buffer);
  const float* xp = float_rows(x, x_buffer);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = out.values;
#ifdef WORKBOOK_SIMD
  const bool ahead = !wr.parted;  // laid out by thread: one stream per thread, asked for with stream_ahead instead
  const Int16Rows& xr = int16_rows(xp, M, K);
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  for_each_row(M, N, [&](int64_t n, int64_t m0, int64_t mr, auto) {
    if (wr.parted && m0 == 0) stream_ahead(wr.at(wp, n), K / 2), stream_ahead(dr.at(dp, n), 4 * (K / g));
    dispatch_rows(mr, [&](auto MR) {
      int4_row<MR.value>(xr, K, wr.at(wp, n), dr.at(dp, n), g, yp + m0 * N + n, N, m0, ahead);
    });
  }, wr.P);
#else
  const at::Half* dp = dm.data_ptr<at::Half>();
  for_each_row(M, N, [&](int64_t n, int64_t m0, int64_t mr, auto) {
    dispatch_rows(mr, [&](auto MR) {
      int4_row<MR.value>(xp + m0 * K, K, wr.at(wp, n), dr.at(dp, n), g, yp + m0 * N + n, N);
    });
  }, wr.P);
#endif
  return finish(out);
}

// w is [N, K] contiguous, or [P, N / P, K] with contiguous rows and any stride between its P parts: a weight laid
// out by thread (utils/cpu_linear.py, pack_by_thread), each part a view into one buffer per thread that holds that
// thread's rows of every projection back to back, so that each thread streams one region through a decode step
// as the bandwidth probe does. Part p's row r is output row p * N / P + r; the sums are those of the [N, K] layout.
// A weight laid out by thread is read without asking for rows ahead into L2 (prefetch_l2): the CPU's own prefetcher
// follows one long stream, and the requests only took its place; it is asked for 8 KiB on with a use-once hint
// instead (stream_ahead). Measured on a 2-core AMD EPYC (AVX-512), SmolLM2's projections alone, the four ways in
// turns in one process (40 rounds, medians, GB/s), before stream_ahead:
//   bf16:    per projection, rows ahead 21.5 / 24.2 (two runs)  by thread, ahead 23.1 / 25.7  by thread, none 32.7 / 29.8
//   float32: per projection, rows ahead 23.0                     by thread, ahead 24.3         by thread, none 26.0
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& w) {
  const WeightRows wr = weight_rows(w, 1);
  const bool parted = wr.parted;
  TORCH_CHECK(wr.valid,
              "float_linear: w must be a contiguous [N, K] or [P, N / P, K] with contiguous rows, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "float_linear: w must be float32 or bf16");
  const int64_t K = w.size(-1), P = wr.P, N = wr.N;
  check_x(x, K, "float_linear");
  const int64_t M = x.size(0);
  const Output out = new_output(x, N, y_buffer);
  const float* xp = float_rows(x, x_buffer);
  float* yp = out.values;
  auto rows = [&](const auto* wp, auto R, bool ahead = false) {  // ahead: the rows 2 KiB on asked for first
    for_each_row<R.value>(M, N, [&](int64_t n, int64_t m0, int64_t mr, auto r) {
      const auto* wn = wr.at(wp, n);
      if (ahead) prefetch_l2(wn, r.value * K * static_cast<int64_t>(sizeof *wp));
      if (parted && m0 == 0) stream_ahead(wn, r.value * K * static_cast<int64_t>(sizeof *wp));
      dispatch_rows(mr, [&](auto MR) { float_block<MR.value, r.value>(xp + m0 * K, K, wn, yp + m0 * N + n, N); });
    }, P);
  };
  if (w.scalar_type() == at::kFloat) {
    // On an AMD CPU one weight row at a time, the rows 2 KiB ahead asked for unless laid out by thread; elsewhere
    // kFloatWeightRows rows, none asked for. Each row's sums run in the same order either way. Measured on a
    // 2-core AMD EPYC (AVX-512), SmolLM2's float32 compiled step at 128 tokens, 3 alternating processes each:
    // 36.2-45.1 tok/s -> 47.0-49.0 (projections alone 22.0-24.6 -> 28.2-30.6 GB/s, one round 18.5); on its
    // AVX2 build 37.7-37.9 -> 50.0-53.3; same tokens. On a 2-core Xeon the four rows without it were fastest.
    static const bool one_row_ahead = __builtin_cpu_is("amd");
    if (one_row_ahead)
      rows(w.data_ptr<float>(), std::integral_constant<int, 1>{}, !parted);
    else
      rows(w.data_ptr<float>(), std::integral_constant<int, kFloatWeightRows>{});
    return finish(out);
  }
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
#ifdef WORKBOOK_SIMD
  const float* xq = pair_rows(xp, M, K, pair_buffer);
  for_each_row(M, N, [&](int64_t n, int64_t m0, int64_t mr, auto) {
    if (parted && m0 == 0) stream_ahead(wr.at(wp, n), 2 * K);
    dispatch_rows(mr, [&](auto MR) { bf16_row<MR.value>(xq + m0 * K, K, wr.at(wp, n), yp + m0 * N + n, N, !parted); });
  }, P);
#else
  rows(wp, std::integral_constant<int, 1>{});
#endif
  return finish(out);
}

// bf16_tiles_linear(x bf16 [M, K], tiles bf16 [N / 16, K / 2, 16, 2], N) -> [M, N] bf16, M <= 16, K a multiple of
// 32: the same product on a CPU's AMX tile unit. ``tiles`` holds W in AMX's pair order, 16 output rows at a time:
// for output rows n0 .. n0 + 15, the 16 pairs (W[n, k], W[n, k + 1]) of each k pair sit side by side, so one 1 KiB
// tile holds 32 values of K for 16 output rows, and a block of 16 output rows is one contiguous stream. One tile
// instruction multiplies x's M rows (32 values each) by such a tile, summing in float32. Each thread takes an even
// share of the blocks, four at a time (four streams in flight). Why: on a 2-core Xeon with AMX, SmolLM2's bf16
// projections alone read 18.9 GB/s this way against 12.8-13.3 for float_linear's rows (two runs, in turns; two
// blocks at a time: 17.6-17.7).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0: x (M rows of 32 bf16), 1-3: a block's weights (16 pairs of rows, 64 bytes each), 4-7: four blocks'
// outputs (M rows of 16 float32). Loaded by every call on every thread, and released at its end: other code
// (oneDNN, inductor's kernels) sets tiles up its own way in between.
void configure_tiles(int64_t M) {
  TileConfig c{};
  c.palette = 1;
  for (int t : {0, 4, 5, 6, 7}) c.rows[t] = static_cast<uint8_t>(M), c.colsb[t] = 64;
  for (int t : {1, 2, 3}) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

at::Tensor bf16_tiles_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t N) {
  static const bool ready = at::cpu::init_amx();
  TORCH_CHECK(ready, "bf16_tiles_linear: this CPU or OS does not let the process use AMX tiles");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == 16 && tiles.size(3) == 2 && tiles.size(0) * 16 == N &&
              tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(),
              "bf16_tiles_linear: tiles must be a contiguous bf16 [N / 16, K / 2, 16, 2]");
  const int64_t K = 2 * tiles.size(1), M = x.size(0), blocks = N / 16;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && M >= 1 && M <= 16 && K % 32 == 0,
              "bf16_tiles_linear: x must be bf16 [M <= 16, K], K a multiple of 32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {  // blocks split evenly: 36 -> 18 + 18
    configure_tiles(M);
    alignas(64) float out[16][64];
    for (int64_t b = first; b < last; b += 4) {
      const int64_t count = std::min<int64_t>(4, last - b);
      const uint16_t* w = wp + b * 16 * K;  // block b + j starts at w + j * 16 * K
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t k = 0; k < K; k += 32) {  // 32 values of K: 16 pairs, one tile per block
        _tile_loadd(0, xp + k, 2 * K);
        _tile_loadd(1, w + 16 * k, 64);
        _tile_dpbf16ps(4, 0, 1);
        if (count > 1) {
          _tile_loadd(2, w + 16 * K + 16 * k, 64);
          _tile_dpbf16ps(5, 0, 2);
        }
        if (count > 2) {
          _tile_loadd(3, w + 32 * K + 16 * k, 64);
          _tile_dpbf16ps(6, 0, 3);
        }
        if (count > 3) {
          _tile_loadd(1, w + 48 * K + 16 * k, 64);
          _tile_dpbf16ps(7, 0, 1);
        }
      }
      _tile_stored(4, &out[0][0], 256);
      _tile_stored(5, &out[0][16], 256);
      _tile_stored(6, &out[0][32], 256);
      _tile_stored(7, &out[0][48], 256);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < 16 * count; ++i) yp[m * N + b * 16 + i] = static_cast<at::BFloat16>(out[m][i]);
    }
    _tile_release();
  });
  return y;
}
#else
at::Tensor bf16_tiles_linear(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "bf16_tiles_linear: these kernels were built without AMX (not this CPU, or a plainer one imitated)");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbook, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor dm, int group_size) -> Tensor");
  m.def("float_linear(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_tiles_linear(Tensor x, Tensor tiles, int n) -> Tensor");
  m.def("set_stream_ahead(int bytes) -> int", &set_stream_ahead);
}

TORCH_LIBRARY_IMPL(workbook, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("float_linear", &float_linear);
  m.impl("bf16_tiles_linear", &bf16_tiles_linear);
}
