// The greedy pick of a decode step on a CPU: the index of each row's largest logit.
//
// greedy_argmax(logits [B, V] float32, bf16 or fp16, last dim contiguous) -> [B] int64: what
// logits.argmax(dim=-1) returns, the first index of the largest value, a NaN counting as the largest (so the
// first NaN, where a row has one), -0 equal to +0.
//
// Why it exists: PyTorch's argmax, eager or compiled by inductor, takes each value in turn, comparing and
// keeping an index: on a 2-core Xeon, 173 us for SmolLM2's 49,152 bf16 logits eager and 137 us inside a
// compiled step, against ~12 ms for the whole bf16 step. Here two passes over integers that the compiler
// vectorizes: the largest key (a float's bits mapped so that integer order is the float's order), then the
// first index holding it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// A float's bits as an unsigned integer that sorts as the float does: negatives' bits inverted, positives'
// sign bit set; -0 first made +0. Positive NaNs sort above +inf, negative ones below -inf (nan_key finds both).
template <typename U>
inline U order_key(U bits) {
  constexpr int kTop = sizeof(U) * 8 - 1;
  constexpr U sign = U(1) << kTop;
  bits = bits == sign ? U(0) : bits;  // -0 -> +0
  return bits ^ (U(U(0) - U(bits >> kTop)) | sign);  // negative: all bits flipped; else the sign bit set
}

template <typename T>
struct Bits;  // the unsigned integer of T's size, and the magnitude of its +inf's bits
template <>
struct Bits<float> { using U = uint32_t; static constexpr U inf = 0x7F800000u; };
template <>
struct Bits<c10::BFloat16> { using U = uint16_t; static constexpr U inf = 0x7F80u; };
template <>
struct Bits<c10::Half> { using U = uint16_t; static constexpr U inf = 0x7C00u; };

template <typename T>
using UnsignedOf = typename Bits<T>::U;

template <typename T>
inline bool is_nan(UnsignedOf<T> bits) {
  return UnsignedOf<T>(bits & (UnsignedOf<T>(~UnsignedOf<T>(0)) >> 1)) > Bits<T>::inf;
}

// The first index i < n with u[i] == the key ``best`` (kNan: the first NaN), a block of 64 at a time: a block
// is first tested whole (vectorized), then searched.
template <typename T, bool kNan>
int64_t first_index(const UnsignedOf<T>* u, int64_t n, UnsignedOf<T> best) {
  constexpr int64_t kBlock = 64;
  const auto hit = [best](UnsignedOf<T> x) { return kNan ? is_nan<T>(x) : order_key(x) == best; };
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    unsigned here = 0;
    for (int64_t i = start; i < end; ++i) here |= hit(u[i]);
    if (here)
      for (int64_t i = start; i < end; ++i)
        if (hit(u[i])) return i;
  }
  return 0;  // not reached: best is one of the keys
}

// First index of one row of n logits (their bits at u) holding the largest value, or the first NaN.
template <typename T>
int64_t row_argmax(const UnsignedOf<T>* u, int64_t n) {
  UnsignedOf<T> best = 0;
  unsigned nan = 0;
  for (int64_t i = 0; i < n; ++i) {  // vectorized: a max and an OR of integers
    best = std::max(best, order_key(u[i]));
    nan |= is_nan<T>(u[i]);
  }
  return nan ? first_index<T, true>(u, n, best) : first_index<T, false>(u, n, best);
}

template <typename T>
void argmax_rows(const at::Tensor& logits, at::Tensor& out) {
  using U = UnsignedOf<T>;
  const int64_t V = logits.size(1), stride = logits.stride(0);
  const U* base = reinterpret_cast<const U*>(logits.data_ptr<T>());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) op[b] = row_argmax<T>(base + b * stride, V);
  });
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_argmax: logits must be [B, V] with V > 0");
  TORCH_CHECK(logits.stride(1) == 1, "greedy_argmax: the last dim must be contiguous");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              "greedy_argmax: float32, bf16 or fp16 logits only, got ", logits.scalar_type());
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat) argmax_rows<float>(logits, out);
  else if (logits.scalar_type() == at::kBFloat16) argmax_rows<c10::BFloat16>(logits, out);
  else argmax_rows<c10::Half>(logits, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbook, m) {
  m.def("greedy_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbook, CPU, m) {
  m.impl("greedy_argmax", &greedy_argmax);
}
