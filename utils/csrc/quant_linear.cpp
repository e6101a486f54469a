// Weight-only int8 and int4 matrix products on a CPU, for decode's few rows: y = x W^T.
//
// int8_linear(x [M, K], q int8 [N, K], scale float32 [N]) -> [M, N] in x's dtype: W = q * scale (per row).
// int4_linear(x [M, K], packed uint8 [N, K / 2], dm float16 [N, K / g, 2], g) -> [M, N] in x's dtype:
//   W[n, k] = q * d + m, (d, m) = dm[n, k / g]; q in [0, 15]. Each block of 32 weights k0 .. k0 + 31 of a row is
//   16 bytes, byte j = q[k0 + j] | q[k0 + 16 + j] << 4 (GGUF's Q4_1 order: one AND and one shift split a block
//   into its two halves). g is a multiple of 32.
// x may be float32, bf16 or fp16; the arithmetic is float32: each weight is rebuilt as a float (q * d + m in one
// FMA) and multiplied by x's float32 row, so the result differs from x @ W^T in float32 only by summation order.
//
// Why it exists: a decode step multiplies one row by every weight matrix, so its time is the weights' bytes over
// the memory bandwidth, if the kernel keeps up with the memory. PyTorch's weight-only kernels on a 2-core AMD
// EPYC (AVX2) read int8 at 8.5 GB/s and int4 at 6.8 GB/s against a probe's 20. Here each thread takes a range of
// output rows and streams them once, for up to four rows of x at a time, with independent accumulators so that
// no FMA waits on the previous one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
// contiguous, else converted into ``buffer``. No new tensor: a decode step makes ~200 of these calls, and two tensor
// conversions per call cost as much as reading a small matrix.
const float* float_rows(const at::Tensor& x, std::vector<float>& buffer) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  buffer.resize(xc.numel());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(xc.scalar_type(), "float_rows", [&] {
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

thread_local std::vector<float> x_buffer, y_buffer;  // the calling thread's, reused call after call

#ifdef WORKBOOK_SIMD
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One int8 weight row against MR rows of x: four accumulators per x row, 32 weights per pass (64 with AVX-512).
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int MR>
void int8_row(const float* x, int64_t K, const int8_t* w, float scale, float* y, int64_t N) {
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
void int8_row(const float* x, int64_t K, const int8_t* w, float scale, float* y, int64_t N) {
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
  std::vector<int16_t> x16;   // [M, K]
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

const Int16Rows& int16_rows(const float* x, int64_t M, int64_t K) {
  thread_local Int16Rows r;  // the calling thread's, reused call after call
  r.x16.resize(M * K), r.scale.resize(M * K / kBlock), r.sum.resize(M * K / kBlock);
  for (int64_t b = 0; b < M * K / kBlock; ++b)
    int16_block(x + b * kBlock, r.x16.data() + b * kBlock, &r.scale[b], &r.sum[b]);
  return r;
}

// One int4 weight row against MR rows of x: y = sum_b d_b dx_b (q_b . x16_b) + m_b sum(x_b). A block's 32 weights
// widen to int16 (two vectors of 16) and meet x16 in two multiply-adds (int32 pairs), one float FMA per block.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// With AVX-512 a block's 32 weights are one vector of int16: one multiply-add per row of x and block. The blocks'
// scales go 16 at a time: d_b * dx_b for each row of x in one multiply, the offsets' sum m_b * sum(x_b) in one FMA,
// so that a block's own work is its weights, its multiply-add, and one FMA whose scale is read from memory.
constexpr int64_t kChunk = 16;  // blocks whose scales are prepared together

template <int MR>
void int4_row(const Int16Rows& xr, int64_t K, const uint8_t* w, const uint16_t* dm, int64_t g, float* y,
              int64_t N, int64_t m0) {
  const int64_t nb = K / kBlock;
  __m512 acc[MR][2], offsets[MR];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = offsets[m] = _mm512_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
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
    int64_t j = 0;
    for (; j + 2 <= nc; j += 2) block(j, 0), block(j + 1, 1);
    if (j < nc) block(j, 0);
  }
  for (int m = 0; m < MR; ++m)
    y[m * N] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), offsets[m]));
}
#else
template <int MR>
void int4_row(const Int16Rows& xr, int64_t K, const uint8_t* w, const uint16_t* dm, int64_t g, float* y,
              int64_t N, int64_t m0) {
  const int64_t nb = K / kBlock;
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
void int8_row(const float* x, int64_t K, const int8_t* w, float scale, float* y, int64_t N) {
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

// Calls row(n, rows of x from m0, MR) for every output row n and block of up to kMaxRows rows of x, output rows
// split across threads.
template <typename Row>
void for_each_row(int64_t M, int64_t N, const Row& row) {
  at::parallel_for(0, N, kGrain, [&](int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      for (int64_t n = first; n < last; ++n) row(n, m0, std::min(kMaxRows, M - m0));
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

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "int8_linear: q must be int8 [N, K]");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == q.size(0) && scale.scalar_type() == at::kFloat,
              "int8_linear: scale must be float32 [N]");
  check_x(x, q.size(1), "int8_linear");
  const int64_t M = x.size(0), K = q.size(1), N = q.size(0);
  const at::Tensor sc = scale.contiguous();
  const Output out = new_output(x, N, y_buffer);
  const float *xp = float_rows(x, x_buffer), *sp = sc.data_ptr<float>();
  const int8_t* wp = q.data_ptr<int8_t>();
  float* yp = out.values;
  for_each_row(M, N, [&](int64_t n, int64_t m0, int64_t mr) {
    dispatch_rows(mr, [&](auto MR) { int8_row<MR.value>(xp + m0 * K, K, wp + n * K, sp[n], yp + m0 * N + n, N); });
  });
  return finish(out);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, int64_t g) {
  TORCH_CHECK(g > 0 && g % kBlock == 0, "int4_linear: the group size must be a multiple of ", kBlock, ", got ", g);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              (2 * packed.size(1)) % g == 0, "int4_linear: packed must be uint8 [N, K / 2], K a multiple of ", g);
  const int64_t M = x.size(0), K = 2 * packed.size(1), N = packed.size(0);
  TORCH_CHECK(dm.dim() == 3 && dm.size(0) == N && dm.size(1) == K / g && dm.size(2) == 2 &&
              dm.scalar_type() == at::kHalf && dm.is_contiguous(), "int4_linear: dm must be float16 [N, K / g, 2]");
  check_x(x, K, "int4_linear");
  const Output out = new_output(x, N, y_buffer);
  const float* xp = float_rows(x, x_buffer);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = out.values;
#ifdef WORKBOOK_SIMD
  const Int16Rows& xr = int16_rows(xp, M, K);
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  for_each_row(M, N, [&](int64_t n, int64_t m0, int64_t mr) {
    dispatch_rows(mr, [&](auto MR) {
      int4_row<MR.value>(xr, K, wp + n * (K / 2), dp + n * 2 * (K / g), g, yp + m0 * N + n, N, m0);
    });
  });
#else
  const at::Half* dp = dm.data_ptr<at::Half>();
  for_each_row(M, N, [&](int64_t n, int64_t m0, int64_t mr) {
    dispatch_rows(mr, [&](auto MR) {
      int4_row<MR.value>(xp + m0 * K, K, wp + n * (K / 2), dp + n * 2 * (K / g), g, yp + m0 * N + n, N);
    });
  });
#endif
  return finish(out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbook, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor dm, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbook, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
