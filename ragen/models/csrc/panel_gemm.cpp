// fp32 linear layers for few rows (decode steps), on weights packed once into column panels: AVX2 + FMA.
//
//   out (M, N) = x (M, K) · Wᵀ (+ b)     with W (N, K) row-major, as F.linear
//
// W is packed once (pack_panels) into P = ⌈N / 16⌉ panels of shape (K, 16): panel p holds output columns
// [16p, 16p + 16) of Wᵀ, zero-padded past N, so that one step of the K loop reads exactly one 64-byte cache line of
// weights. linear_panels then computes, for each panel and each block of up to 6 rows, the 6 × 16 outputs in twelve
// ymm accumulators: per k, two weight loads, six broadcasts of x[r, k] and twelve FMAs (out[r, n] summed over k in
// order, one rounding per FMA; F.linear's BLAS sums in another order, so results agree to float rounding). Panels are
// split between the OpenMP threads; the first row block of a panel prefetches the weights DIST lines ahead, so the
// stream from memory overlaps the FMAs.
//
// Why: at decode batches (8-32 rows) this CPU's BLAS (MKL on an AVX2 EPYC) ran SmolLM2's projections at 32-60 % of
// the fp32 matmul peak, with the weights streaming from memory once per step; this layout reads each weight once, in
// order (docs/performance.md, "panel GEMM"). Built by ragen/models/native.py with -march=native -fopenmp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "ragen's panel GEMM needs AVX2 and FMA (-march=native on a CPU with avx2 and fma)"
#endif

using at::Tensor;

namespace {

constexpr int64_t kCols = 16;  // output columns per panel: two ymm of fp32
constexpr int64_t kRows = 6;   // rows per register block: 6 × 2 accumulators + 2 weights + 1 broadcast = 15 ymm
constexpr int64_t kDist = 48;  // prefetch distance, in k steps (cache lines) ahead

// out[r, 0 .. cols) = x[r, :] · panel (+ bias) for r < ROWS (a compile-time count: the accumulators stay in
// registers); x rows ldx apart, out rows ldo apart; with fetch_end, prefetch the weights up to that address
template <int ROWS>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo, int64_t cols,
                  const float* bias, const float* fetch_end) {
  __m256 acc0[ROWS], acc1[ROWS];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* ahead = panel + (k + kDist) * kCols;
    if (fetch_end != nullptr && ahead < fetch_end) _mm_prefetch((const char*)ahead, _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kCols), w1 = _mm256_loadu_ps(panel + k * kCols + 8);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(xv, w0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(xv, w1, acc1[r]);
    }
  }
  // the panel's last columns may lie past N: masked loads and stores (lanes < cols)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols - 8), lane);
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm256_maskload_ps(bias, m0);
    b1 = _mm256_maskload_ps(bias + 8, m1);
  }
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) {
    _mm256_maskstore_ps(out + r * ldo, m0, bias != nullptr ? _mm256_add_ps(acc0[r], b0) : acc0[r]);
    _mm256_maskstore_ps(out + r * ldo + 8, m1, bias != nullptr ? _mm256_add_ps(acc1[r], b1) : acc1[r]);
  }
}

}  // namespace

// W (N, K) fp32 -> panels (⌈N/16⌉, K, 16) fp32, zero past N
Tensor pack_panels(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "the weight must be a 2-D fp32 CPU tensor (out, in)");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kCols - 1) / kCols;
  TORCH_CHECK(N > 0 && K > 0, "the weight must not be empty");
  const Tensor w = weight.contiguous();
  Tensor panels = N % kCols == 0 ? at::empty({P, K, kCols}, w.options()) : at::zeros({P, K, kCols}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(kCols, N - p * kCols);
      const float* rows = src + p * kCols * K;
      float* panel = dst + p * K * kCols;
      for (int64_t k = 0; k < K; ++k)  // written in order; read as `cols` sequential streams, one per row of W
        for (int64_t j = 0; j < cols; ++j) panel[k * kCols + j] = rows[j * K + k];
    }
  });
  return panels;
}

// x (M, K) fp32 · Wᵀ (+ bias (N,)) -> (M, N) fp32 row-major, W given as pack_panels(W) with N = out_features
Tensor linear_panels(const Tensor& x, const Tensor& panels, int64_t out_features, const std::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == kCols && panels.size(1) == x.size(1),
              "panels must be pack_panels(W) of a weight with x's input size");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = panels.size(0);
  TORCH_CHECK(N > (P - 1) * kCols && N <= P * kCols, "out_features does not match the panels");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "the bias must be fp32, contiguous, of out_features elements");
  const Tensor xc = x.contiguous();
  Tensor out = at::empty({M, N}, xc.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    const float* range_end = wp + p1 * K * kCols;  // this thread's panels are contiguous: prefetch up to their end
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(kCols, N - p * kCols);
      const float* panel = wp + p * K * kCols;
      const float* b = bp != nullptr ? bp + p * kCols : nullptr;
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const float* xr = xp + r0 * K;
        float* o = op + r0 * N + p * kCols;
        const float* fetch = r0 == 0 ? range_end : nullptr;  // later row blocks find the panel in cache
        switch (std::min(kRows, M - r0)) {
          case 6: block<6>(xr, K, panel, K, o, N, cols, b, fetch); break;
          case 5: block<5>(xr, K, panel, K, o, N, cols, b, fetch); break;
          case 4: block<4>(xr, K, panel, K, o, N, cols, b, fetch); break;
          case 3: block<3>(xr, K, panel, K, o, N, cols, b, fetch); break;
          case 2: block<2>(xr, K, panel, K, o, N, cols, b, fetch); break;
          default: block<1>(xr, K, panel, K, o, N, cols, b, fetch); break;
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY(ragen_gemm, m) {
  m.def("pack_panels(Tensor weight) -> Tensor", &pack_panels);
  m.def("linear_panels(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor", &linear_panels);
}
