// pdserve's CPU kernels for decode steps, where torch's are far from what the CPU can do.
//
// gemv_bf16: one-row projections, y[0, o] = sum_i x[0, i] * w[o, i] (+ b[o]), on CPUs with
// AVX512-BF16. A decode step of one sequence multiplies one row by every weight of the model: it
// is a stream of the weights through the cores, and the kernel's whole job is to keep that stream
// at memory speed. Four weight rows at a time, 32 bfloat16 pairs per _mm512_dpbf16_ps,
// accumulated in float32 and rounded to bfloat16 once (round to nearest even, as every other
// bfloat16 result in torch).
//
// rms_norm_bf16: Hugging Face's RMSNorm arithmetic for a bfloat16 model, in one pass per row where
// torch runs eight kernels (each tens of microseconds of dispatch on a 576-value row):
// h = bf16(x * rsqrt(mean(x^2) + eps)) in float32, then bf16(w * h).
//
// decode_attention (below): one query token per row over its context in the paged cache.
//
// Rows are split across torch's own intra-op threads (at::parallel_for, compiled with -fopenmp so
// it calls the OpenMP runtime torch already loaded): no second thread pool competes for the cores.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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

torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "rms_norm_bf16: bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "rms_norm_bf16: a CPU tensor");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "rms_norm_bf16: weight must be [dim]");
  const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = wc.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t rows = dim == 0 ? 0 : xc.numel() / dim;
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, dim)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* xr = xp + r * dim;
      at::BFloat16* yr = yp + r * dim;
      float squares = 0.0f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xr[i]);
        squares += v * v;
      }
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + epsilon);
      for (int64_t i = 0; i < dim; ++i) {
        const float h = static_cast<float>(at::BFloat16(static_cast<float>(xr[i]) * scale));
        yr[i] = at::BFloat16(static_cast<float>(wp[i]) * h);
      }
    }
  });
  return y;
}

// decode_attention: one query token per row against its own context in the paged cache, read in
// place through the row's block table: no gather of the context into a padded copy, no mask.
// Scores, softmax and the weighted sum of values in float32; the result rounded once to the
// cache's dtype.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const at::BFloat16* p, __mmask16 m) {  // bfloat16 is float32's upper half
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
void decode_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& table,
                 const torch::Tensor& lengths, double scale, torch::Tensor& out, bool hnd) {
  const int64_t rows = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = hnd ? k.size(1) : k.size(2), block = hnd ? k.size(2) : k.size(1);
  const int64_t group = q_heads / kv_heads, chunks = (dim + 15) / 16;
  const int64_t block_stride = k.stride(0), slot_stride = hnd ? k.stride(2) : k.stride(1);
  const int64_t head_stride = hnd ? k.stride(1) : k.stride(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t table_width = table.size(1);
  const float factor = static_cast<float>(scale);
  auto mask_of = [&](int64_t c) -> __mmask16 {  // the lanes of chunk c inside dim
    const int64_t n = std::min<int64_t>(16, dim - c * 16);
    return static_cast<__mmask16>((1u << n) - 1);
  };
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, total(group);
    std::vector<__m512> query(group * chunks), acc(group * chunks);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads, length = lp[row];
      const int64_t* blocks = tp + row * table_width;
      scores.resize(group * length);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < chunks; ++c)
          query[g * chunks + c] = load16(qp + row * q.stride(0) + (head * group + g) * q.stride(1) + c * 16, mask_of(c));
      for (int64_t t = 0; t < length; ++t) {  // scores: q . k, scaled
        const T* key = kp + blocks[t / block] * block_stride + (t % block) * slot_stride + head * head_stride;
        for (int64_t g = 0; g < group; ++g) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c) dot = _mm512_fmadd_ps(query[g * chunks + c], load16(key + c * 16, mask_of(c)), dot);
          scores[g * length + t] = _mm512_reduce_add_ps(dot) * factor;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax, its division left for the end
        float* s = scores.data() + g * length;
        const float top = *std::max_element(s, s + length);
        total[g] = 0.0f;
        for (int64_t t = 0; t < length; ++t) {
          s[t] = std::exp(s[t] - top);
          total[g] += s[t];
        }
      }
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      for (int64_t t = 0; t < length; ++t) {  // the weighted sum of values
        const T* value = vp + blocks[t / block] * block_stride + (t % block) * slot_stride + head * head_stride;
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512 x = load16(value + c * 16, mask_of(c));
          for (int64_t g = 0; g < group; ++g)
            acc[g * chunks + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * length + t]), x, acc[g * chunks + c]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = op + (row * q_heads + head * group + g) * dim;
        alignas(64) float lanes[16];
        for (int64_t c = 0; c < chunks; ++c) {
          _mm512_store_ps(lanes, _mm512_div_ps(acc[g * chunks + c], _mm512_set1_ps(total[g])));
          for (int64_t d = 0; d < std::min<int64_t>(16, dim - c * 16); ++d) o[c * 16 + d] = static_cast<T>(lanes[d]);
        }
      }
    }
  });
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& table, const torch::Tensor& lengths, double scale, bool hnd) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "decode_attention: q must be [rows, heads, dim], dim contiguous");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides() && k.stride(3) == 1,
              "decode_attention: k and v must be one layer's [blocks, slots, heads, dim] (or HND) of one cache");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "decode_attention: q, k and v of one dtype");
  TORCH_CHECK(table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(0) == q.size(0) && lengths.numel() == q.size(0) && table.is_contiguous() &&
                  lengths.is_contiguous(),
              "decode_attention: a [rows, blocks] table and [rows] lengths of int64");
  const int64_t kv_heads = hnd ? k.size(1) : k.size(2), block = hnd ? k.size(2) : k.size(1);
  TORCH_CHECK(q.size(2) == k.size(3) && kv_heads > 0 && q.size(1) % kv_heads == 0,
              "decode_attention: q heads must be a multiple of the cache's kv heads, of one head size");
  // Every block a row reads is checked before any is read: a wrong table raises, as torch's gather would,
  // instead of reading outside the cache.
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(lp[r] > 0 && lp[r] <= table.size(1) * block, "decode_attention: a length outside its block table");
    for (int64_t i = 0; i < (lp[r] + block - 1) / block; ++i)
      TORCH_CHECK(tp[r * table.size(1) + i] >= 0 && tp[r * table.size(1) + i] < k.size(0),
                  "decode_attention: a block id outside the cache");
  }
  torch::Tensor out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    decode_rows<float>(q, k, v, table, lengths, scale, out, hnd);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "decode_attention: float32 or bfloat16");
    decode_rows<at::BFloat16>(q, k, v, table, lengths, scale, out, hnd);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16, "y = x w^T (+ b) for one bfloat16 row x [1, in], w [out, in]",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none());
  m.def("rms_norm_bf16", &rms_norm_bf16, "Hugging Face's RMSNorm of bfloat16 x [..., dim] with weight [dim]",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("decode_attention", &decode_attention, "one query token per row over its context in the paged cache",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("table"), pybind11::arg("lengths"),
        pybind11::arg("scale"), pybind11::arg("hnd"));
}
