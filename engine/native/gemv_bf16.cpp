// One-row bfloat16 projections: y[0, o] = sum_i x[0, i] * w[o, i] (+ b[o]), for decode steps of one
// sequence on CPUs with AVX512-BF16.
//
// A decode step of one sequence multiplies one row by every weight of the model: it is a stream of
// the weights through the cores, and the kernel's whole job is to keep that stream at memory speed.
// Four weight rows at a time, 32 bfloat16 pairs per _mm512_dpbf16_ps, accumulated in float32 and
// rounded to bfloat16 once (round to nearest even, as every other bfloat16 result in torch), the
// rows split across torch's own intra-op threads (at::parallel_for), so no second thread pool ever
// competes with torch's for the cores.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

constexpr int64_t kRows = 4;     // weight rows per pass over x
constexpr int64_t kLanes = 32;   // bfloat16 values per 512-bit load
constexpr int64_t kGrain = 1 << 16;  // weight values per task below which one thread does it all

inline __m512bh load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_tail(const uint16_t* p, int64_t n) {  // n < kLanes values, the rest zero
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ULL << n) - 1), p);
}

inline at::BFloat16 finish(__m512 acc, const at::BFloat16* bias, int64_t row) {
  float sum = _mm512_reduce_add_ps(acc);
  if (bias != nullptr) sum += static_cast<float>(bias[row]);
  return at::BFloat16(sum);
}

}  // namespace

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "gemv_bf16: x must be one row [1, in]");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "gemv_bf16: w must be [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.is_contiguous(), "gemv_bf16: contiguous CPU weight");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor bc;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->numel() == w.size(0) && b->scalar_type() == at::kBFloat16, "gemv_bf16: bias must be [out] bfloat16");
    bc = b->contiguous();
  }
  const int64_t out = w.size(0), in = w.size(1);
  const int64_t full = in / kLanes * kLanes, tail = in - full;
  torch::Tensor y = torch::empty({1, out}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const at::BFloat16* bp = bc.defined() ? bc.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (out + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrain / (kRows * in));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r = blk * kRows;
      if (r + kRows <= out) {
        const uint16_t* w0 = wp + r * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < full; i += kLanes) {
          const __m512bh xx = load(xp + i);
          a0 = _mm512_dpbf16_ps(a0, load(w0 + i), xx);
          a1 = _mm512_dpbf16_ps(a1, load(w0 + in + i), xx);
          a2 = _mm512_dpbf16_ps(a2, load(w0 + 2 * in + i), xx);
          a3 = _mm512_dpbf16_ps(a3, load(w0 + 3 * in + i), xx);
        }
        if (tail != 0) {
          const __m512bh xx = load_tail(xp + full, tail);
          a0 = _mm512_dpbf16_ps(a0, load_tail(w0 + full, tail), xx);
          a1 = _mm512_dpbf16_ps(a1, load_tail(w0 + in + full, tail), xx);
          a2 = _mm512_dpbf16_ps(a2, load_tail(w0 + 2 * in + full, tail), xx);
          a3 = _mm512_dpbf16_ps(a3, load_tail(w0 + 3 * in + full, tail), xx);
        }
        yp[r] = finish(a0, bp, r);
        yp[r + 1] = finish(a1, bp, r + 1);
        yp[r + 2] = finish(a2, bp, r + 2);
        yp[r + 3] = finish(a3, bp, r + 3);
        continue;
      }
      for (int64_t row = r; row < out; ++row) {  // the last rows, fewer than kRows
        const uint16_t* wr = wp + row * in;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < full; i += kLanes) acc = _mm512_dpbf16_ps(acc, load(wr + i), load(xp + i));
        if (tail != 0) acc = _mm512_dpbf16_ps(acc, load_tail(wr + full, tail), load_tail(xp + full, tail));
        yp[row] = finish(acc, bp, row);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16, "y = x w^T (+ b) for one bfloat16 row x [1, in], w [out, in]",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none());
}
