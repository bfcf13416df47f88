// pdserve's CPU kernels for decode steps, where torch's are far from what the CPU can do.
//
// gemv_bf16: projections of a few rows, y[m, o] = sum_i x[m, i] * w[o, i] (+ b[o]), on CPUs with
// AVX512-BF16. A decode step of a few sequences multiplies a few rows by every weight of the model:
// it is a stream of the weights through the cores, and the kernel's whole job is to keep that stream
// at memory speed. Four weight rows at a time, 32 bfloat16 pairs per _mm512_dpbf16_ps,
// accumulated in float32 and rounded to bfloat16 once (round to nearest even, as every other
// bfloat16 result in torch).
//
// gemv_f32 (below): the same for one to eight float32 rows, over the input-major weight.
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
#include <ATen/core/dispatch/Dispatcher.h>
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

// acc[j] += w[j] . u for the kRows weight rows, and acc[kRows + j] += w[j] . v with a second x row (X = 2).
template <int X>
inline void accumulate(__m512* acc, const __m512bh* w, __m512bh u, __m512bh v) {
  for (int64_t j = 0; j < kRows; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], w[j], u);
  if (X == 2)
    for (int64_t j = 0; j < kRows; ++j) acc[kRows + j] = _mm512_dpbf16_ps(acc[kRows + j], w[j], v);
}

// The kRows weight rows at w0 against one x row (X = 1) or two (X = 2): X * kRows float32 sums in acc,
// each over the lanes in one order whatever X is, so a row's result is the same alone or paired. With
// `next`, the same lines of the next kRows weight rows are prefetched on the way.
template <int X>
inline void block_dots(const uint16_t* x0, const uint16_t* x1, const uint16_t* w0, int64_t in, const uint16_t* next,
                       __m512* acc) {
  const int64_t full = in / kLanes * kLanes, tail = in - full;
  __m512bh w[kRows];
  for (int64_t j = 0; j < X * kRows; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += kLanes) {
    if (next != nullptr) {
      for (int64_t j = 0; j < kRows; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * in + i), _MM_HINT_T0);
    }
    for (int64_t j = 0; j < kRows; ++j) w[j] = load(w0 + j * in + i);
    const __m512bh u = load(x0 + i);
    accumulate<X>(acc, w, u, X == 2 ? load(x1 + i) : u);
  }
  if (tail != 0) {
    for (int64_t j = 0; j < kRows; ++j) w[j] = load_tail(w0 + j * in + full, tail);
    const __m512bh u = load_tail(x0 + full, tail);
    accumulate<X>(acc, w, u, X == 2 ? load_tail(x1 + full, tail) : u);
  }
}

// y[m, o] = sum_i x[m, i] * w[o, i] (+ b[o]) for a few bfloat16 rows x [rows, in] and w [out, in]: weight
// rows split across torch's threads, kRows per pass, each pass read from memory once for every x row (two
// at a time, from L1 after the first). The rows of w are read in order, but as kRows interleaved streams
// that the hardware prefetcher follows late: each pass also prefetches the same lines of the next kRows
// rows (1.2x on SmolLM2's projections streamed from L3).
void gemv_into(const uint16_t* xp, int64_t rows, const uint16_t* wp, const at::BFloat16* bp, at::BFloat16* yp,
               int64_t out, int64_t in) {
  const int64_t full = in / kLanes * kLanes, tail = in - full;
  const int64_t blocks = (out + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrain / (kRows * in));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    __m512 acc[2 * kRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r = blk * kRows;
      if (r + kRows <= out) {
        const uint16_t* w0 = wp + r * in;
        for (int64_t m = 0; m < rows; m += 2) {
          const uint16_t* next = m == 0 ? w0 + kRows * in : nullptr;  // a prefetch never faults, even past the end
          const uint16_t* x0 = xp + m * in;
          const int64_t pair = m + 1 < rows ? 2 : 1;
          if (pair == 2) {
            block_dots<2>(x0, x0 + in, w0, in, next, acc);
          } else {
            block_dots<1>(x0, nullptr, w0, in, next, acc);
          }
          for (int64_t k = 0; k < pair; ++k)
            for (int64_t j = 0; j < kRows; ++j) yp[(m + k) * out + r + j] = finish(acc[k * kRows + j], bp, r + j);
        }
        continue;
      }
      for (int64_t row = r; row < out; ++row) {  // the last rows, fewer than kRows
        const uint16_t* wr = wp + row * in;
        for (int64_t m = 0; m < rows; ++m) {
          const uint16_t* x0 = xp + m * in;
          __m512 sum = _mm512_setzero_ps();
          for (int64_t i = 0; i < full; i += kLanes) sum = _mm512_dpbf16_ps(sum, load(wr + i), load(x0 + i));
          if (tail != 0) sum = _mm512_dpbf16_ps(sum, load_tail(wr + full, tail), load_tail(x0 + full, tail));
          yp[m * out + row] = finish(sum, bp, row);
        }
      }
    }
  });
}

inline const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "gemv_bf16: x must be rows [rows, in]");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "gemv_bf16: w must be [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.is_contiguous(), "gemv_bf16: contiguous CPU weight");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor bc;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->numel() == w.size(0) && b->scalar_type() == at::kBFloat16, "gemv_bf16: bias must be [out] bfloat16");
    bc = b->contiguous();
  }
  torch::Tensor y = torch::empty({x.size(0), w.size(0)}, x.options());
  gemv_into(bits(xc), x.size(0), bits(w), bc.defined() ? bc.data_ptr<at::BFloat16>() : nullptr,
            y.data_ptr<at::BFloat16>(), w.size(0), w.size(1));
  return y;
}

// gemv_f32: the float32 projection of a few rows (up to kF32Rows), y[m, o] = sum_i x[m, i] * w[o, i] (+ b[o]),
// reading the weight where engine.model.Linear keeps it for float32: input-major, wt[i, o] = w[o, i]. A
// step of a few decodes streams every weight of the model through the cores, and oneDNN's packed matmul
// streams them below memory speed for so few rows (1.3x slower at eight). Each thread owns a range of
// 16-column units; the input runs in chunks of kChunk rows of wt, so a chunk is kChunk sequential streams
// through the thread's columns, with every x row's sums for a pass of units held in registers and kept
// in y between chunks. Each sum runs over the input in order, one fused multiply-add per value: a
// row's result is the same alone or with others, on any number of threads.
constexpr int64_t kF32Rows = 8;
constexpr int64_t kF32Lanes = 16;
// A thread's columns are taken kF32BlockUnits units (4096 columns) at a time, every chunk of the input over
// one block before the next: the rows' partial sums of a block (16 KB a row) stay in cache between chunks,
// where over a whole wide projection (a 262,144-token vocabulary: 1 MB a row) each chunk would write them
// out to memory and read them back. On Gemma 3's lm_head (640 x 262,144), one thread, CPU time: 8 rows
// 58 -> 39 ms, 4 rows 38 -> 31 ms, 1 and 2 rows as before (a plain read of the weight: 17 ms).
constexpr int64_t kF32BlockUnits = 256;

// The units [col, col + Z * 16) of y's rows over wt's rows [k0, k1): sums start at zero (k0 == 0) or from
// y, and end with the bias when k1 is the last input row. Masked: one unit of fewer than 16 columns.
template <int M, int Z, bool Masked>
inline void f32_units(const float* x, int64_t in, const float* wt, int64_t out, const float* bias, float* y,
                      int64_t k0, int64_t k1, int64_t col, __mmask16 mask) {
  __m512 acc[M][Z];
  for (int m = 0; m < M; ++m)
    for (int z = 0; z < Z; ++z)
      acc[m][z] = k0 == 0 ? _mm512_setzero_ps()
                  : Masked ? _mm512_maskz_loadu_ps(mask, y + m * out + col + 16 * z)
                           : _mm512_loadu_ps(y + m * out + col + 16 * z);
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = wt + k * out + col;
    __m512 wv[Z];
    for (int z = 0; z < Z; ++z) wv[z] = Masked ? _mm512_maskz_loadu_ps(mask, w + 16 * z) : _mm512_loadu_ps(w + 16 * z);
    for (int m = 0; m < M; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * in + k]);
      for (int z = 0; z < Z; ++z) acc[m][z] = _mm512_fmadd_ps(xm, wv[z], acc[m][z]);
    }
  }
  for (int z = 0; z < Z; ++z) {
    if (k1 == in && bias != nullptr) {
      const __m512 b = Masked ? _mm512_maskz_loadu_ps(mask, bias + col + 16 * z) : _mm512_loadu_ps(bias + col + 16 * z);
      for (int m = 0; m < M; ++m) acc[m][z] = _mm512_add_ps(acc[m][z], b);
    }
    for (int m = 0; m < M; ++m) {
      if (Masked) {
        _mm512_mask_storeu_ps(y + m * out + col + 16 * z, mask, acc[m][z]);
      } else {
        _mm512_storeu_ps(y + m * out + col + 16 * z, acc[m][z]);
      }
    }
  }
}

// Z = 4 units (64 columns) per pass for up to four rows, 2 for more: M * Z sums in registers, 16 at most.
// The chunk's lines of the pass two ahead are prefetched (2 ahead in the thread's order: the next chunk's
// first passes at the end of a chunk). Chunks and passes as measured on SmolLM2's projections.
template <int M>
void f32_rows(const float* x, int64_t in, const float* wt, int64_t out, const float* bias, float* y) {
  constexpr int Z = M <= 4 ? 4 : 2;
  constexpr int64_t kChunk = M <= 4 ? 16 : 32;
  const int64_t full = out / kF32Lanes, tail = out % kF32Lanes;
  const __mmask16 mask = static_cast<__mmask16>((1u << tail) - 1);
  at::parallel_for(0, full + (tail != 0), 1, [&](int64_t range_begin, int64_t range_end) {
   for (int64_t begin = range_begin; begin < range_end; begin += kF32BlockUnits) {
    const int64_t end = std::min(range_end, begin + kF32BlockUnits);
    const int64_t last = std::min(end, full);  // units [begin, last) are whole; [last, end) is the masked one
    const int64_t passes = (last - begin + Z - 1) / Z;
    for (int64_t k0 = 0; k0 < in; k0 += kChunk) {
      const int64_t k1 = std::min(in, k0 + kChunk);
      for (int64_t p = 0; p < passes; ++p) {
        int64_t ahead = p + 2, chunk = k0;
        if (ahead >= passes) ahead -= passes, chunk += kChunk;
        if (ahead < passes)
          for (int64_t k = chunk; k < std::min(in, chunk + kChunk); ++k) {
            const float* line = wt + k * out + (begin + ahead * Z) * kF32Lanes;
            for (int z = 0; z < Z; ++z) _mm_prefetch(reinterpret_cast<const char*>(line + z * kF32Lanes), _MM_HINT_T0);
          }
        const int64_t unit = begin + p * Z, col = unit * kF32Lanes;
        if (last - unit >= Z) {
          f32_units<M, Z, false>(x, in, wt, out, bias, y, k0, k1, col, 0);
        } else {  // the thread's last pass, short
          for (int64_t u = unit; u < last; ++u)
            f32_units<M, 1, false>(x, in, wt, out, bias, y, k0, k1, u * kF32Lanes, 0);
        }
      }
      if (last < end) f32_units<M, 1, true>(x, in, wt, out, bias, y, k0, k1, last * kF32Lanes, mask);
    }
   }
  });
}

// w is [out, in] as engine.model.Linear holds a float32 weight: a transposed view of an input-major tensor.
torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kF32Rows, "gemv_f32: x must be 1 to ", kF32Rows,
              " rows [rows, in]");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "gemv_f32: w must be [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "gemv_f32: float32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.stride(0) == 1 && w.stride(1) == w.size(0),
              "gemv_f32: w must be a CPU tensor whose transpose [in, out] is contiguous");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor bc;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->numel() == w.size(0) && b->scalar_type() == at::kFloat, "gemv_f32: bias must be [out] float32");
    bc = b->contiguous();
  }
  const int64_t in = w.size(1), out = w.size(0);
  torch::Tensor y = torch::empty({x.size(0), out}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  switch (x.size(0)) {
    case 1: f32_rows<1>(xp, in, wp, out, bp, yp); break;
    case 2: f32_rows<2>(xp, in, wp, out, bp, yp); break;
    case 3: f32_rows<3>(xp, in, wp, out, bp, yp); break;
    case 4: f32_rows<4>(xp, in, wp, out, bp, yp); break;
    case 5: f32_rows<5>(xp, in, wp, out, bp, yp); break;
    case 6: f32_rows<6>(xp, in, wp, out, bp, yp); break;
    case 7: f32_rows<7>(xp, in, wp, out, bp, yp); break;
    default: f32_rows<8>(xp, in, wp, out, bp, yp); break;
  }
  return y;
}

// Hugging Face's RMSNorm of `rows` rows of `dim` values each (rows split across torch's threads).
void norm_into(const at::BFloat16* xp, const at::BFloat16* wp, at::BFloat16* yp, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, dim)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* xr = xp + r * dim;
      at::BFloat16* yr = yp + r * dim;
      float squares = 0.0f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xr[i]);
        squares += v * v;
      }
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const float h = static_cast<float>(at::BFloat16(static_cast<float>(xr[i]) * scale));
        yr[i] = at::BFloat16(static_cast<float>(wp[i]) * h);
      }
    }
  });
}

torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "rms_norm_bf16: bfloat16 only");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "rms_norm_bf16: a CPU tensor");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "rms_norm_bf16: weight must be [dim]");
  const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  norm_into(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
            dim == 0 ? 0 : xc.numel() / dim, dim, static_cast<float>(eps));
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

// torch's own vectorised exp (Sleef's, exported by libtorch_cpu), for decode attention's softmax and SiLU.
extern "C" __m512 Sleef_expf16_u10(__m512);

// The sums of 16 vectors' lanes at once: lane i of the result is v[i]'s sum (in another order than
// _mm512_reduce_add_ps's), where 16 of those would each wait on a chain of shuffles.
inline __m512 sums_of_16(const __m512* v) {
  __m512 quads[4];  // 128-bit lane j of quads[g] holds v[4g..4g+3]'s partial sums over their lane j
  for (int g = 0; g < 4; ++g) {
    const __m512 a = v[4 * g], b = v[4 * g + 1], c = v[4 * g + 2], d = v[4 * g + 3];
    const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
    const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
    quads[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  }
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44), _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44), _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// How far ahead of the token being scored decode attention's far prefetch runs (see decode_rows).
constexpr int64_t kFarAhead = 32;

inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }

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
  const __m512 factor = _mm512_set1_ps(static_cast<float>(scale));
  auto mask_of = [&](int64_t c) { return first_lanes(dim - c * 16); };  // the lanes of chunk c inside dim
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, total(group);
    std::vector<int64_t> offsets;  // token t's K (and V) for this task's head: kp + offsets[t] (vp + offsets[t])
    std::vector<__m512> query(group * chunks), acc(group * chunks);
    __m512 dots[16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads, length = lp[row];
      const int64_t* blocks = tp + row * table_width;
      offsets.resize(length);  // walked block by block: no division per token
      for (int64_t t0 = 0, b = 0; t0 < length; t0 += block, ++b) {
        const int64_t start = blocks[b] * block_stride + head * head_stride;
        for (int64_t s = 0; s < std::min(block, length - t0); ++s) offsets[t0 + s] = start + s * slot_stride;
      }
      auto slot = [&](const T* base, int64_t t) { return base + offsets[t]; };
      scores.resize(group * length);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < chunks; ++c)
          query[g * chunks + c] = load16(qp + row * q.stride(0) + (head * group + g) * q.stride(1) + c * 16, mask_of(c));
      for (int64_t t0 = 0; t0 < length; t0 += 16) {  // scores: q . k, scaled, 16 tokens at a time
        const int64_t n = std::min<int64_t>(16, length - t0);
        // The cache is read in scattered blocks, too short for the hardware to run ahead of: the next
        // 16 keys, and these 16 tokens' values for the pass below, are fetched while these are scored.
        for (int64_t i = 0; i < std::min<int64_t>(16, length - t0 - 16); ++i)
          for (int64_t line = 0; line < dim * int64_t(sizeof(T)); line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(slot(kp, t0 + 16 + i)) + line, _MM_HINT_T0);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t line = 0; line < dim * int64_t(sizeof(T)); line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(slot(vp, t0 + i)) + line, _MM_HINT_T1);
        // One step ahead of the next keys is not enough to hide memory's latency: the 16 tokens after
        // them are requested too, their keys into L2 and values into L3, so that more lines are in
        // flight at once.
        for (int64_t i = t0 + kFarAhead; i < std::min<int64_t>(length, t0 + kFarAhead + 16); ++i)
          for (int64_t line = 0; line < dim * int64_t(sizeof(T)); line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(slot(kp, i)) + line, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(slot(vp, i)) + line, _MM_HINT_T2);
          }
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < 16; ++i) {
            dots[i] = _mm512_setzero_ps();
            if (i >= n) continue;
            const T* key = slot(kp, t0 + i);
            for (int64_t c = 0; c < chunks; ++c)
              dots[i] = _mm512_fmadd_ps(query[g * chunks + c], load16(key + c * 16, mask_of(c)), dots[i]);
          }
          _mm512_mask_storeu_ps(scores.data() + g * length + t0, first_lanes(n), _mm512_mul_ps(sums_of_16(dots), factor));
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax, its division left for the end
        float* s = scores.data() + g * length;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < length; t += 16)
          top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(length - t), s + t));
        const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < length; t += 16) {
          const __mmask16 m = first_lanes(length - t);
          const __m512 e = _mm512_maskz_mov_ps(m, Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), peak)));
          _mm512_mask_storeu_ps(s + t, m, e);
          sum = _mm512_add_ps(sum, e);
        }
        total[g] = _mm512_reduce_add_ps(sum);
      }
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      for (int64_t t = 0; t < length; ++t) {  // the weighted sum of values
        const T* value = slot(vp, t);
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

// DecodeLayer: one decoder layer (Llama, Qwen2, Qwen3) for a step of decode rows only, in one call from Python
// where engine/model.py's DecoderLayer makes some twenty: RMSNorm, the fused q/k/v projection,
// Qwen3's per-head q/k norms, rotary embedding, the write of k and v into the paged cache, attention,
// o_proj, the residual, RMSNorm, gate/up, SiLU(gate) * up, down_proj and the residual.
//
// The layer's output and the cache it writes equal the op-by-op layer's on the same CPU bit for bit
// (tests/engine/test_native.py): every value is rounded to the model's dtype exactly where torch's
// ops round it on that path, the file is compiled without contracting a * b + c into one rounding,
// and SiLU's exp is torch's own (Sleef's, as its vectorised kernel calls it; std::exp for the tail
// its scalar loop takes). Projections and norms run what engine.model.Linear and RMSNorm run for the
// same rows: gemv_bf16 or oneDNN's packed matmul (bfloat16), gemv_f32, torch's linear or the packed
// matmul (float32), rms_norm_bf16 or rms_norm_f32.

namespace {

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }  // float32: as is; bfloat16: to nearest even

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

// x [heads, dim] in place: x * cos + roll(x, dim / 2) * sin_signed, each product and the sum rounded.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t dim, const T* cos, const T* sin) {
  std::vector<float> row(dim);
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * dim;
    for (int64_t i = 0; i < dim; ++i) row[i] = widen(xh[i]);
    for (int64_t i = 0; i < dim; ++i) {
      const float a = widen(round_to<T>(row[i] * widen(cos[i])));
      const float b = widen(round_to<T>(row[(i + half) % dim] * widen(sin[i])));
      xh[i] = round_to<T>(a + b);
    }
  }
}

// out[i] = silu(gate[i]) * up[i], each rounded, silu as torch's kernel computes it: x / (1 + exp(-x)) in
// float32, two vectors of T at a time with Sleef's exp, the remainder one by one with std::exp.
template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  const int64_t step = 2 * 64 / static_cast<int64_t>(sizeof(T)), vectorised = n / step * step;
  alignas(64) float lanes[16];
  for (int64_t i = 0; i < vectorised; i += 16) {
    const __m512 x = load16(gate + i, 0xFFFF);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_store_ps(lanes, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    for (int64_t j = 0; j < 16; ++j) out[i + j] = round_to<T>(widen(round_to<T>(lanes[j])) * widen(up[i + j]));
  }
  for (int64_t i = vectorised; i < n; ++i) {
    const float x = widen(gate[i]);
    out[i] = round_to<T>(widen(round_to<T>(x / (1.0f + std::exp(-x)))) * widen(up[i]));
  }
}

// torch's float32 rms_norm, then the weight (engine.model.RMSNorm): x * rsqrt(mean(x * x) + eps), each op
// rounded as torch's are, its sum of squares by torch's own sum (the one order-dependent step); the rest
// without the five kernel launches of torch's composite.
torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& w, int64_t dim, double eps) {
  const int64_t rows = x.numel() / dim;
  torch::Tensor squares = torch::empty({rows, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = squares.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrain / dim);  // rows split across torch's threads, as its own ops do
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * dim; i < end * dim; ++i) sp[i] = xp[i] * xp[i];
  });
  const torch::Tensor sums = squares.sum(-1);
  const float* total = sums.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  torch::Tensor y = torch::empty_like(x);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float mean = total[r] / static_cast<float>(dim);
      const float rstd = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = xp[r * dim + i] * rstd;
        yp[r * dim + i] = wp[i] * normed;
      }
    }
  });
  return y;
}

}  // namespace

torch::Tensor rms_norm_f32_checked(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm_f32: float32 only");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0, "rms_norm_f32: a CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm_f32: weight must be [dim]");
  const torch::Tensor xc = x.contiguous();
  return rms_norm_f32(xc, weight.contiguous(), x.size(-1), eps).view(x.sizes());
}

namespace {

template <typename T>
void add_into(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = round_to<T>(widen(a[i]) + widen(b[i]));
}

}  // namespace

class DecodeLayer {
 public:
  DecodeLayer(const torch::Tensor& input_norm, const torch::Tensor& qkv, const c10::optional<torch::Tensor>& qkv_bias,
              const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
              const torch::Tensor& o, const torch::Tensor& post_norm, const torch::Tensor& gate_up,
              const c10::optional<torch::Tensor>& gate_up_bias, const torch::Tensor& down,
              const c10::optional<torch::Tensor>& down_bias, int64_t heads, int64_t kv_heads, int64_t head_dim,
              double eps, double scale, const std::vector<torch::Tensor>& packed, int64_t packed_min_rows,
              int64_t few_rows_max)
      : dtype_(qkv.scalar_type()),
        heads_(heads),
        kv_heads_(kv_heads),
        dim_(head_dim),
        eps_(eps),
        scale_(scale),
        packed_min_rows_(packed_min_rows),
        few_rows_max_(few_rows_max) {
    TORCH_CHECK(dtype_ == at::kBFloat16 || dtype_ == at::kFloat, "DecodeLayer: float32 or bfloat16 weights");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0, "DecodeLayer: bad head counts");
    TORCH_CHECK(few_rows_max >= 0 && (dtype_ == at::kBFloat16 || few_rows_max <= kF32Rows),
                "DecodeLayer: few_rows_max must be 0 to ", kF32Rows, " for float32");
    hidden_ = input_norm.numel();
    intermediate_ = down.dim() == 2 ? down.size(1) : 0;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    input_norm_ = values(input_norm, hidden_, "input_norm");
    post_norm_ = values(post_norm, hidden_, "post_norm");
    qkv_ = weight(qkv, q_size + 2 * kv_size, hidden_, "qkv");
    qkv_bias_ = values(qkv_bias, q_size + 2 * kv_size, "qkv_bias");
    q_norm_ = values(q_norm, head_dim, "q_norm");
    k_norm_ = values(k_norm, head_dim, "k_norm");
    TORCH_CHECK(q_norm_.defined() == k_norm_.defined(), "DecodeLayer: q_norm and k_norm go together");
    o_ = weight(o, hidden_, q_size, "o");
    gate_up_ = weight(gate_up, 2 * intermediate_, hidden_, "gate_up");
    gate_up_bias_ = values(gate_up_bias, 2 * intermediate_, "gate_up_bias");
    down_ = weight(down, hidden_, intermediate_, "down");
    down_bias_ = values(down_bias, hidden_, "down_bias");
    TORCH_CHECK(input_norm_.defined() && post_norm_.defined(), "DecodeLayer: both norms' weights are needed");
    TORCH_CHECK(packed.empty() || packed.size() == 4, "DecodeLayer: packed is qkv, o, gate_up and down's, or none");
    if (!packed.empty()) {
      for (const torch::Tensor& p : packed)
        TORCH_CHECK(p.scalar_type() == dtype_ && p.device().is_cpu(), "DecodeLayer: packed weights of the weights' dtype");
      qkv_packed_ = packed[0];
      o_packed_ = packed[1];
      gate_up_packed_ = packed[2];
      down_packed_ = packed[3];
    }
  }

  // The decode rows of a step, and nothing else: x [rows, hidden]; cos and sin_signed [rows, ..., head_dim], each
  // row's position; cache one layer's [2, blocks, ...] (NHD or HND); slots [rows] each row's flat slot; table
  // [rows, blocks] and lengths [rows] as for decode_attention.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                        const torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& table,
                        const torch::Tensor& lengths, bool hnd) const {
    TORCH_CHECK(x.scalar_type() == dtype_ && x.dim() == 2 && x.size(0) >= 1 && x.size(1) == hidden_ && x.is_contiguous(),
                "DecodeLayer: x must be contiguous rows [rows, ", hidden_, "] of the weights' dtype");
    const int64_t rows = x.size(0);
    TORCH_CHECK(cos.scalar_type() == dtype_ && sin_signed.scalar_type() == dtype_ && cos.numel() == rows * dim_ &&
                    sin_signed.numel() == rows * dim_ && cos.is_contiguous() && sin_signed.is_contiguous(),
                "DecodeLayer: cos and sin_signed must be each row's ", dim_, " values of the weights' dtype");
    TORCH_CHECK(cache.scalar_type() == dtype_ && cache.dim() == 5 && cache.size(0) == 2 && cache.size(4) == dim_ &&
                    (hnd ? cache.size(2) : cache.size(3)) == kv_heads_ && cache.stride(4) == 1,
                "DecodeLayer: cache must be one layer's [2, blocks, ...] of the weights' dtype with ", kv_heads_,
                " heads of ", dim_);
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows && slots.is_contiguous(),
                "DecodeLayer: slots must be one int64 per row");
    if (dtype_ == at::kFloat) return run<float>(x, cos, sin_signed, cache, slots, table, lengths, hnd);
    return run<at::BFloat16>(x, cos, sin_signed, cache, slots, table, lengths, hnd);
  }

 private:
  template <typename T>
  torch::Tensor run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                    const torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& table,
                    const torch::Tensor& lengths, bool hnd) const {
    const torch::Tensor k_cache = cache.select(0, 0), v_cache = cache.select(0, 1);
    const int64_t rows = x.size(0), block = hnd ? k_cache.size(2) : k_cache.size(1);
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(slot[r] >= 0 && slot[r] < k_cache.size(0) * block, "DecodeLayer: a slot outside the cache");
    const int64_t q_size = heads_ * dim_, kv_size = kv_heads_ * dim_, width = q_size + 2 * kv_size;

    const torch::Tensor qkv = project(norm(x, input_norm_), qkv_, qkv_packed_, qkv_bias_);
    torch::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    int64_t q_stride = width, k_stride = width;  // from one row's heads to the next row's
    if (q_norm_.defined()) {
      q = norm(q.view({rows, heads_, dim_}), q_norm_);
      k = norm(k.view({rows, kv_heads_, dim_}), k_norm_);
      q_stride = q_size;
      k_stride = kv_size;
    }
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin_signed.data_ptr<T>();
    const int64_t slot_stride = hnd ? k_cache.stride(2) : k_cache.stride(1);
    const int64_t head_stride = hnd ? k_cache.stride(1) : k_cache.stride(2);
    for (int64_t r = 0; r < rows; ++r) {
      T* qr = qp + r * q_stride;
      T* kr = kp + r * k_stride;
      const T* vr = vp + r * width;
      rotate_heads(qr, heads_, dim_, cp + r * dim_, sp + r * dim_);
      rotate_heads(kr, kv_heads_, dim_, cp + r * dim_, sp + r * dim_);
      const int64_t offset = slot[r] / block * k_cache.stride(0) + slot[r] % block * slot_stride;
      T* k_to = k_cache.data_ptr<T>() + offset;
      T* v_to = v_cache.data_ptr<T>() + offset;
      for (int64_t head = 0; head < kv_heads_; ++head) {
        std::copy(kr + head * dim_, kr + (head + 1) * dim_, k_to + head * head_stride);
        std::copy(vr + head * dim_, vr + (head + 1) * dim_, v_to + head * head_stride);
      }
    }
    const torch::Tensor attn =
        decode_attention(q.view({rows, heads_, dim_}), k_cache, v_cache, table, lengths, scale_, hnd);

    const torch::Tensor o = project(attn.view({rows, q_size}), o_, o_packed_, torch::Tensor());
    torch::Tensor mid = torch::empty({rows, hidden_}, x.options());
    add_into(x.data_ptr<T>(), o.data_ptr<T>(), mid.data_ptr<T>(), rows * hidden_);
    const torch::Tensor gate_up = project(norm(mid, post_norm_), gate_up_, gate_up_packed_, gate_up_bias_);
    torch::Tensor act = torch::empty({rows, intermediate_}, x.options());
    if (rows * intermediate_ < at::internal::GRAIN_SIZE) {
      // torch's SiLU runs on one thread below this many values, row by row: the same loop here
      for (int64_t r = 0; r < rows; ++r) {
        const T* gu = gate_up.data_ptr<T>() + r * 2 * intermediate_;
        silu_mul(gu, gu + intermediate_, act.data_ptr<T>() + r * intermediate_, intermediate_);
      }
    } else {  // above it, torch splits the values across threads where a row's vectorised part ends elsewhere
      act = at::mul(at::silu(gate_up.narrow(1, 0, intermediate_)), gate_up.narrow(1, intermediate_, intermediate_));
    }
    const torch::Tensor down = project(act, down_, down_packed_, down_bias_);
    torch::Tensor out = torch::empty({rows, hidden_}, x.options());
    add_into(mid.data_ptr<T>(), down.data_ptr<T>(), out.data_ptr<T>(), rows * hidden_);
    return out;
  }

  // x [rows, in] -> [rows, out], as engine.model.Linear projects it: up to few_rows_max rows by this file's
  // gemv of the dtype; the oneDNN-packed weight for more bfloat16 rows, and for packed_min_rows float32 rows
  // and more; torch's linear otherwise (float32 below that: the input-major weight).
  torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& packed,
                        const torch::Tensor& b) const {
    const int64_t rows = x.size(0);
    const std::optional<at::Tensor> bias = b.defined() ? std::optional<at::Tensor>(b) : std::nullopt;
    if (rows <= few_rows_max_) return dtype_ == at::kBFloat16 ? gemv_bf16(x, w, bias) : gemv_f32(x, w, bias);
    if (packed.defined() && (dtype_ == at::kBFloat16 || rows >= packed_min_rows_)) {
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                             c10::string_view, c10::List<std::optional<at::Scalar>>,
                                             std::optional<c10::string_view>)>();
      return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
    }
    return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
  }

  // Hugging Face's RMSNorm over the last dim, contiguous, as engine.model.RMSNorm runs it: the one-pass kernel
  // (bfloat16) or rms_norm_f32, torch's arithmetic bit for bit (float32).
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w) const {
    return dtype_ == at::kFloat ? rms_norm_f32_checked(x, w, eps_) : rms_norm_bf16(x, w, eps_);
  }

  torch::Tensor weight(const torch::Tensor& w, int64_t rows, int64_t cols, const char* name) const {
    // read in place for a few rows: bfloat16 as [out, in] rows, float32 input-major (gemv_f32); float32 weights
    // go to torch's linear in any layout where no rows do
    const bool input_major = dtype_ == at::kFloat && few_rows_max_ > 0;
    TORCH_CHECK(w.scalar_type() == dtype_ && w.device().is_cpu() && w.dim() == 2 && w.size(0) == rows &&
                    w.size(1) == cols &&
                    (input_major ? w.stride(0) == 1 && w.stride(1) == rows : dtype_ == at::kFloat || w.is_contiguous()),
                "DecodeLayer: ", name, " must be a CPU tensor [", rows, ", ", cols, "] of the weights' dtype",
                input_major ? ", input-major (its transpose contiguous)" : dtype_ == at::kFloat ? "" : ", contiguous");
    return w;
  }

  torch::Tensor values(const c10::optional<torch::Tensor>& v, int64_t n, const char* name) const {
    if (!v.has_value() || !v->defined()) return torch::Tensor();
    TORCH_CHECK(v->scalar_type() == dtype_ && v->device().is_cpu() && v->is_contiguous() && v->numel() == n,
                "DecodeLayer: ", name, " must be a contiguous CPU tensor of ", n, " values of the weights' dtype");
    return v->view({n});
  }

  at::ScalarType dtype_;
  int64_t heads_, kv_heads_, dim_, hidden_ = 0, intermediate_ = 0;
  double eps_, scale_;
  int64_t packed_min_rows_, few_rows_max_;
  torch::Tensor input_norm_, qkv_, qkv_bias_, q_norm_, k_norm_, o_, post_norm_, gate_up_, gate_up_bias_, down_, down_bias_;
  torch::Tensor qkv_packed_, o_packed_, gate_up_packed_, down_packed_;  // oneDNN's layout (engine.model.Linear.packed)
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16, "y = x w^T (+ b) for a few bfloat16 rows x [rows, in], w [out, in]",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none());
  m.def("gemv_f32", &gemv_f32, "y = x w^T (+ b) for 1 to 8 float32 rows x [rows, in], w [out, in] input-major",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none());
  m.def("rms_norm_bf16", &rms_norm_bf16, "Hugging Face's RMSNorm of bfloat16 x [..., dim] with weight [dim]",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("decode_attention", &decode_attention, "one query token per row over its context in the paged cache",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("table"), pybind11::arg("lengths"),
        pybind11::arg("scale"), pybind11::arg("hnd"));
  m.def("rms_norm_f32", &rms_norm_f32_checked, "torch's float32 rms_norm of x [..., dim], times weight [dim]",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  pybind11::class_<DecodeLayer>(m, "DecodeLayer", "one decoder layer of a float32 or bfloat16 model for a step of decode rows")
      .def(pybind11::init<const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                          const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&, const torch::Tensor&,
                          const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                          const torch::Tensor&, const c10::optional<torch::Tensor>&, int64_t, int64_t, int64_t, double,
                          double, const std::vector<torch::Tensor>&, int64_t, int64_t>(),
           pybind11::arg("input_norm"), pybind11::arg("qkv"), pybind11::arg("qkv_bias"), pybind11::arg("q_norm"),
           pybind11::arg("k_norm"), pybind11::arg("o"), pybind11::arg("post_norm"), pybind11::arg("gate_up"),
           pybind11::arg("gate_up_bias"), pybind11::arg("down"), pybind11::arg("down_bias"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("packed"), pybind11::arg("packed_min_rows"), pybind11::arg("few_rows_max"))
      .def("__call__", &DecodeLayer::forward, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin_signed"),
           pybind11::arg("cache"), pybind11::arg("slots"), pybind11::arg("table"), pybind11::arg("lengths"),
           pybind11::arg("hnd"));
}
