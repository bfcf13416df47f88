// pdserve's float32 logits kernel, built for any x86-64 CPU with AVX2 and FMA (engine/native/__init__.py
// builds it apart from kernels.cpp, whose kernels need AVX-512).
//
// logits_f32: y[m, v] = sum_i x[m, i] * w[v, i] for one to eight float32 rows x [rows, in] over a weight
// w [vocab, in] read as it is stored: a tied lm_head reads the embedding matrix itself, row by row, where
// a projection kept input-major ([in, vocab]) would need a copy of it (671 MB for Gemma 3's 262,144 x 640).
// Each weight row is read from memory once for every x row (x stays in L1): a decode step's lm_head
// streams the matrix once, whatever the batch. Each pass also prefetches the lines of the next pass's
// rows (at 8 rows 1.15x, at 4 rows 1.35x on Gemma 3's lm_head, one thread, CPU time). Rows of w are split across torch's own intra-op threads
// (at::parallel_for, compiled with -fopenmp so it calls the OpenMP runtime torch already loaded).
//
// Every sum runs over its row in 8 lanes, in order, one fused multiply-add per value, then adds the lanes
// in one fixed tree: a row's logits are the same alone or with others, on any number of threads.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kLanes = 8;  // float32 values per 256-bit load

inline __m256i tail_mask(int64_t n) {  // the first n < 8 lanes
  alignas(32) static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones + 8 - n));
}

// The lane sums of a[0..7]: out[j] = ((a_j0 + a_j1) + (a_j2 + a_j3)) + ((a_j4 + a_j5) + (a_j6 + a_j7)).
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// R weight rows from v against the M rows of x: R * M <= 8 sums, accumulator r * M + m.
template <int M, int R>
inline void rows_block(const float* x, const float* w, int64_t in, int64_t vocab, int64_t v, float* y) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t full = in / kLanes * kLanes, tail = in - full;
  const float* wr = w + v * in;
  for (int64_t i = 0; i < full; i += kLanes) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * in + i);
    if ((i & 15) == 0)  // the same line of the next R rows: R interleaved streams that the prefetcher follows late
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr + (R + r) * in + i), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(wr + r * in + i);
      for (int m = 0; m < M; ++m) acc[r * M + m] = _mm256_fmadd_ps(wv, xv[m], acc[r * M + m]);
    }
  }
  if (tail != 0) {
    const __m256i mask = tail_mask(tail);
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_maskload_ps(x + m * in + full, mask);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_maskload_ps(wr + r * in + full, mask);
      for (int m = 0; m < M; ++m) acc[r * M + m] = _mm256_fmadd_ps(wv, xv[m], acc[r * M + m]);
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, reduce8(acc));
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * vocab + v + r] = sums[r * M + m];
}

// R weight rows per pass: as many as keep R * M <= 8 sums in registers (8 for one x row, 1 from five).
template <int M>
void logits_rows(const float* x, const float* w, int64_t in, int64_t vocab, float* y) {
  constexpr int R = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;
  const int64_t blocks = vocab / R;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, R * in));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rows_block<M, R>(x, w, in, vocab, b * R, y);
  });
  for (int64_t v = blocks * R; v < vocab; ++v) rows_block<M, 1>(x, w, in, vocab, v, y);
}

}  // namespace

torch::Tensor logits_f32(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, "logits_f32: x must be 1 to ", kMaxRows,
              " rows [rows, in]");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "logits_f32: w must be [vocab, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "logits_f32: float32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.is_contiguous(),
              "logits_f32: CPU tensors, w contiguous");
  const torch::Tensor xc = x.contiguous();
  const int64_t in = w.size(1), vocab = w.size(0);
  torch::Tensor y = torch::empty({x.size(0), vocab}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (x.size(0)) {
    case 1: logits_rows<1>(xp, wp, in, vocab, yp); break;
    case 2: logits_rows<2>(xp, wp, in, vocab, yp); break;
    case 3: logits_rows<3>(xp, wp, in, vocab, yp); break;
    case 4: logits_rows<4>(xp, wp, in, vocab, yp); break;
    case 5: logits_rows<5>(xp, wp, in, vocab, yp); break;
    case 6: logits_rows<6>(xp, wp, in, vocab, yp); break;
    case 7: logits_rows<7>(xp, wp, in, vocab, yp); break;
    default: logits_rows<8>(xp, wp, in, vocab, yp); break;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("logits_f32", &logits_f32, "float32 logits of 1-8 rows over a [vocab, in] weight as stored", py::arg("x"),
        py::arg("w"));
}
