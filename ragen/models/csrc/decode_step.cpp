// One bf16 decode step of a Llama-family model on the grouped shared-prefix path, in C++.
//
// The same arithmetic as ragen/models/fused_decode.py's decode_step when it takes _attend_grouped (rows in groups
// of `group` sharing a prompt, every own column kept in the group layout), with the step's ~2 400 small ATen calls
// and their Python replaced by a few fused loops per layer:
//
//   x      = bf16((h · rsqrt(mean(h²) + eps)) · w_in)                   add_rms_norm_bf16 (with the residual add)
//   qkv    = x W_qkvᵀ (+ b)                                            oneDNN's packed GEMM, as PackedLinear
//   q, k   = qkv's heads · cos + swap(heads) · [-sin₁, sin₂]  (fp32)    rotate_and_scatter, which also writes
//            k, v to the KV cache and to the group buffers, and q · D^-½ to the grouped query rows
//   p      = softmax(q_grouped K_tᵀ + bias)                             two fp32 bmm (ATen) and ATen's softmax
//   h     += (p V) W_oᵀ;  h += W_down (bf16(silu(gate)) · up)           silu_mul_bf16 for the MLP's activation
//
// and after the last layer the final norm and the LM head. Rounding points are transformers' under bf16 autocast
// (fp32 residual stream and norms, bf16 projections, fp32 rotary and attention). Sums may run in another order than
// ATen's (the norm's mean of squares, the exp of silu to within ~2 ulp before its bf16 rounding), so results equal
// the Python step's up to float rounding (tests/models/test_native_decode.py).
//
// Needs AVX-512 BF16 (the only CPUs where ragen computes in bf16 on the CPU by default); built by
// ragen/models/native.py with -march=native.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "ragen's native decode kernels need AVX-512 F/BW/VL and BF16 (-march=native on a CPU with avx512_bf16)"
#endif

using at::BFloat16;
using at::Tensor;

namespace {

constexpr int64_t kMaxHeadDim = 512;

// oneDNN's linear on a packed weight: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") -> (M, out)
Tensor packed_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<
      Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, std::string_view,
             c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

inline __m512 load_bf16(const BFloat16* p) {  // 16 bf16 -> fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store_bf16(BFloat16* p, __m512 x) {  // fp32 -> bf16, round to nearest even
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(x));
}
inline __m512 round_bf16(__m512 x) {  // float(bf16(x))
  __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// h (B, C) fp32 += float(delta) (bf16 (B, C), or none); then out (B, C) bf16 = bf16((h · r) · w) with
// r = 1 / sqrt(mean(h²) + eps): F.rms_norm of the fp32 stream with an fp32 weight (as fused_decode._rms_norm takes
// it), cast for a bf16 projection.
void add_rms_norm_bf16(float* h, const BFloat16* delta, const float* w, float eps, BFloat16* out, int64_t B, int64_t C) {
  at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* r = h + b * C;
      int64_t c = 0;
      if (delta != nullptr) {
        const BFloat16* d = delta + b * C;
        for (; c + 16 <= C; c += 16) _mm512_storeu_ps(r + c, _mm512_add_ps(_mm512_loadu_ps(r + c), load_bf16(d + c)));
        for (; c < C; ++c) r[c] += (float)d[c];
      }
      __m512 acc = _mm512_setzero_ps();
      for (c = 0; c + 16 <= C; c += 16) {
        __m512 v = _mm512_loadu_ps(r + c);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      float s = _mm512_reduce_add_ps(acc);
      for (; c < C; ++c) s += r[c] * r[c];
      const float inv = 1.0f / std::sqrt(s / (float)C + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      BFloat16* o = out + b * C;
      for (c = 0; c + 16 <= C; c += 16)
        store_bf16(o + c, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(r + c), vinv), _mm512_loadu_ps(w + c)));
      for (; c < C; ++c) o[c] = (BFloat16)((r[c] * inv) * w[c]);
    }
  });
}

// e^x for 16 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial), within ~2 ulp;
// 0 below -88.38, +inf above.
inline __m512 exp512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  const __m512 xc = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 e = _mm512_scalef_ps(p, n);
  const __m512 big = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), e, _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), big, _mm512_setzero_ps());
}

// out (B, I) bf16 = bf16(float(bf16(silu(gate))) · float(up)) for gate_up (B, 2·I) bf16 = [gate | up]: F.silu on the
// bf16 gate, then the bf16 product, as transformers' LlamaMLP under autocast.
void silu_mul_bf16(const BFloat16* gate_up, BFloat16* out, int64_t B, int64_t I) {
  at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int64_t b = b0; b < b1; ++b) {
      const BFloat16* g = gate_up + b * 2 * I;
      const BFloat16* u = g + I;
      BFloat16* o = out + b * I;
      int64_t c = 0;
      for (; c + 16 <= I; c += 16) {
        const __m512 z = load_bf16(g + c);
        const __m512 silu = round_bf16(_mm512_div_ps(z, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, z)))));
        store_bf16(o + c, _mm512_mul_ps(silu, load_bf16(u + c)));
      }
      for (; c < I; ++c) {
        const float z = (float)g[c];
        o[c] = (BFloat16)((float)(BFloat16)(z / (1.0f + std::exp(-z))) * (float)u[c]);
      }
    }
  });
}

// The rotary embedding of one row's query and key heads from its qkv (bf16), in fp32 as fused_decode._rotate:
// r = x · cos + swap(x) · sin_signed, swap(x) = [x₂, x₁]. Writes
//   grouped[u, kv, j·g + hq, :] = r(query head kv·g + hq) · scaling       (the group's query rows, as _grouped_queries)
//   keys[b, kv, :] = r(key head kv), then (keys_to_groups) keys_t[u, kv, :, col + j];
//   values[u, kv, col + j, :] = v(kv)                                         (the group buffers, fp32)
//   cache_k[b, kv, pos, :] = r(key head kv) (fp32);  cache_v[b, kv, pos, :] = v(kv) (bf16)   (the row's KV cache)
// for row b = u·k + j.
struct Scatter {
  int64_t H, H_kv, D, g, k, col, pos;
  float scaling;
  float *grouped, *keys, *keys_t, *values, *cache_k;
  BFloat16* cache_v;
  at::IntArrayRef kts, vts, cks, cvs;

  void row(int64_t b, const BFloat16* qkv, const float* cos, const float* sin) const {
    const int64_t u = b / k, j = b % k, half = D / 2;
    alignas(64) float x[kMaxHeadDim], r[kMaxHeadDim];
    for (int64_t head = 0; head < H + H_kv; ++head) {
      const BFloat16* xh = qkv + head * D;
      for (int64_t d = 0; d < D; d += 16) {  // bf16 -> fp32, exactly; the last chunk masked
        const __mmask16 m = d + 16 <= D ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
        const __m256i raw = _mm256_maskz_loadu_epi16(m, xh + d);
        _mm512_mask_storeu_ps(x + d, m, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
      }
      for (int64_t d = 0; d < half; ++d) r[d] = x[d] * cos[d] + x[d + half] * sin[d];
      for (int64_t d = half; d < D; ++d) r[d] = x[d] * cos[d] + x[d - half] * sin[d];
      if (head < H) {
        const int64_t kv = head / g, hq = head % g;
        float* dst = grouped + ((u * H_kv + kv) * (k * g) + j * g + hq) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = r[d] * scaling;
      } else {
        const int64_t kv = head - H;
        float* ck = cache_k + b * cks[0] + kv * cks[1] + pos * cks[2];
        float* staged = keys + (b * H_kv + kv) * D;
        for (int64_t d = 0; d < D; ++d) {
          staged[d] = r[d];
          ck[d * cks[3]] = r[d];
        }
      }
    }
    for (int64_t kv = 0; kv < H_kv; ++kv) {
      const BFloat16* v = qkv + (H + H_kv + kv) * D;
      float* vt = values + u * vts[0] + kv * vts[1] + (col + j) * vts[2];
      BFloat16* cv = cache_v + b * cvs[0] + kv * cvs[1] + pos * cvs[2];
      for (int64_t d = 0; d < D; ++d) {
        vt[d * vts[3]] = (float)v[d];
        cv[d * cvs[3]] = v[d];
      }
    }
  }

  // keys_t[u, kv, d, col + j] = keys[u·k + j, kv, d]: a group's k new columns are adjacent in each of keys_t's rows,
  // so writing them group by group touches k times fewer cache lines than row by row (keys_t's rows are W apart)
  void keys_to_groups(int64_t B) const {
    for (int64_t u = 0; u < B / k; ++u)
      for (int64_t kv = 0; kv < H_kv; ++kv)
        for (int64_t d = 0; d < D; ++d) {
          float* dst = keys_t + u * kts[0] + kv * kts[1] + d * kts[2] + col * kts[3];
          for (int64_t j = 0; j < k; ++j) dst[j * kts[3]] = keys[((u * k + j) * H_kv + kv) * D + d];
        }
  }
};

// Attention of the group's query rows over its n columns, for one group u and KV head kv (fp32):
//   S = Q K_tᵀ-layout product (R × n) + bias,  P = softmax(S) per row,  O = P V (R × D)
// with Q (R, D) the scaled query rows (R = k·g), K_t (D, n) at row stride kt_stride, V (n, D) at row stride
// v_stride, bias (R, n) at row stride bias_stride; out row r at out + r_out(r). The same products and sums as
// shared_prefix._attend_grouped's two fp32 bmm and softmax, summed in another order (each score over d in order,
// each output over the columns in order) and with exp512 for the softmax's exp.
struct GroupAttention {
  int64_t R, D, n;
  const float *q, *kt, *v, *bias;
  int64_t kt_stride, v_stride, bias_stride;
  float* scores;  // (R_pad, n_pad) scratch

  static constexpr int RB = 4;  // query rows per register block

  // S[r0 .. r0 + ROWS) = Q K_t + bias, -inf past n (ROWS a compile-time count: the accumulators stay in registers)
  template <int ROWS>
  void score_rows(int64_t r0, int64_t np) const {
    const int64_t n16 = np / 16;
    const float* qr = q + r0 * D;
    for (int64_t c = 0; c < n16; ++c) {
      const __mmask16 m = c * 16 + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c * 16)) - 1);
      __m512 acc[ROWS];
#pragma GCC unroll 4
      for (int rr = 0; rr < ROWS; ++rr) acc[rr] = _mm512_setzero_ps();
      const float* kc = kt + c * 16;
      const bool fetch = r0 == 0 && c + 2 < n16;  // the first row block reads K_t from memory: fetch 2 chunks ahead
      for (int64_t d = 0; d < D; ++d) {
        if (fetch) _mm_prefetch((const char*)(kc + 32 + d * kt_stride), _MM_HINT_T0);
        const __m512 kv = _mm512_maskz_loadu_ps(m, kc + d * kt_stride);
#pragma GCC unroll 4
        for (int rr = 0; rr < ROWS; ++rr) acc[rr] = _mm512_fmadd_ps(_mm512_set1_ps(qr[rr * D + d]), kv, acc[rr]);
      }
#pragma GCC unroll 4
      for (int rr = 0; rr < ROWS; ++rr) {
        const __m512 b = _mm512_maskz_loadu_ps(m, bias + (r0 + rr) * bias_stride + c * 16);
        // past n: -inf, so the row's max and sum ignore the padding lanes
        _mm512_storeu_ps(scores + (r0 + rr) * np + c * 16,
                         _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), _mm512_add_ps(acc[rr], b)));
      }
    }
  }

  // out[r0 .. r0 + ROWS) = P V, 64 of D at a time
  template <int ROWS>
  void value_rows(int64_t r0, int64_t np, float* out) const {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __mmask16 dm[4];
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const int64_t left = D - d0 - 16 * t;
        dm[t] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
      }
      __m512 acc[ROWS][4];
#pragma GCC unroll 4
      for (int rr = 0; rr < ROWS; ++rr)
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) acc[rr][t] = _mm512_setzero_ps();
      const float* pr = scores + r0 * np;
      const bool fetch = r0 == 0;  // the first row block reads V from memory: fetch 8 columns ahead
      for (int64_t c = 0; c < n; ++c) {
        const float* vr = v + c * v_stride + d0;
        if (fetch && c + 8 < n)
          for (int64_t t = 0; t < std::min<int64_t>(64, D - d0); t += 16)
            _mm_prefetch((const char*)(vr + 8 * v_stride + t), _MM_HINT_T0);
        __m512 vv[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) vv[t] = _mm512_maskz_loadu_ps(dm[t], vr + 16 * t);
#pragma GCC unroll 4
        for (int rr = 0; rr < ROWS; ++rr) {
          const __m512 p = _mm512_set1_ps(pr[rr * np + c]);
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t) acc[rr][t] = _mm512_fmadd_ps(p, vv[t], acc[rr][t]);
        }
      }
#pragma GCC unroll 4
      for (int rr = 0; rr < ROWS; ++rr)
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) _mm512_mask_storeu_ps(out + (r0 + rr) * D + d0 + 16 * t, dm[t], acc[rr][t]);
    }
  }

  void run(float* out) const {
    const int64_t np = (n + 15) / 16 * 16;
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      switch (std::min<int64_t>(RB, R - r0)) {
        case 4: score_rows<4>(r0, np); break;
        case 3: score_rows<3>(r0, np); break;
        case 2: score_rows<2>(r0, np); break;
        default: score_rows<1>(r0, np); break;
      }
    }
    for (int64_t r = 0; r < R; ++r) {  // softmax, in place
      float* sr = scores + r * np;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < np; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + c));
      const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < np; c += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + c), vmax));
        _mm512_storeu_ps(sr + c, e);
        sum = _mm512_add_ps(sum, e);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
      for (int64_t c = 0; c < np; c += 16) _mm512_storeu_ps(sr + c, _mm512_mul_ps(_mm512_loadu_ps(sr + c), inv));
    }
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      switch (std::min<int64_t>(RB, R - r0)) {
        case 4: value_rows<4>(r0, np, out); break;
        case 3: value_rows<3>(r0, np, out); break;
        case 2: value_rows<2>(r0, np, out); break;
        default: value_rows<1>(r0, np, out); break;
      }
    }
  }
};

void check_layer_buffers(const Tensor& kt, const Tensor& vt, const Tensor& ck, const Tensor& cv, int64_t U, int64_t B,
                         int64_t H_kv, int64_t D, int64_t n, int64_t pos) {
  TORCH_CHECK(kt.scalar_type() == at::kFloat && vt.scalar_type() == at::kFloat, "group buffers must be fp32");
  TORCH_CHECK(ck.scalar_type() == at::kFloat && cv.scalar_type() == at::kBFloat16,
              "the KV cache must hold fp32 keys and bf16 values");
  TORCH_CHECK(kt.dim() == 4 && kt.size(0) == U && kt.size(1) == H_kv && kt.size(2) == D && kt.size(3) >= n,
              "keys_t must be (U, H_kv, D, >= n)");
  TORCH_CHECK(vt.dim() == 4 && vt.size(0) == U && vt.size(1) == H_kv && vt.size(2) >= n && vt.size(3) == D,
              "values must be (U, H_kv, >= n, D)");
  TORCH_CHECK(ck.dim() == 4 && ck.size(0) == B && ck.size(1) == H_kv && ck.size(2) > pos && ck.size(3) == D,
              "cache keys must be (B, H_kv, > pos, D)");
  TORCH_CHECK(cv.dim() == 4 && cv.size(0) == B && cv.size(1) == H_kv && cv.size(2) > pos && cv.size(3) == D,
              "cache values must be (B, H_kv, > pos, D)");
}

}  // namespace

// Logits (B, V) bf16 of one decode step; the step's keys and values written to the cache at column `pos` and to the
// group buffers at columns [col, col + group), of n = col + group filled ones. h (B, C) fp32: the new tokens'
// embeddings; cos, sin (B | 1, 1, D) fp32 (sin as fused_decode.signed_sin); bias (U | 1, 1, group·g, >= n) fp32.
Tensor decode_grouped(const Tensor& embeddings, const Tensor& cos, const Tensor& sin, at::TensorList norm_in,
                      at::ArrayRef<double> eps_in, at::TensorList w_qkv, const c10::List<std::optional<Tensor>>& b_qkv,
                      at::TensorList w_o, const c10::List<std::optional<Tensor>>& b_o, at::TensorList norm_post,
                      at::ArrayRef<double> eps_post, at::TensorList w_gate_up, at::TensorList w_down,
                      at::TensorList keys_t, at::TensorList values, at::TensorList cache_k, at::TensorList cache_v,
                      const Tensor& bias, int64_t group, int64_t col, int64_t pos, int64_t H, int64_t H_kv,
                      double scaling, const Tensor& norm, double norm_eps, const Tensor& w_head) {
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.scalar_type() == at::kFloat, "embeddings must be (B, C) fp32");
  TORCH_CHECK(H > 0 && H_kv > 0 && H % H_kv == 0 && group > 0 && col >= 0 && pos >= 0, "unsupported head layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                  cos.dim() >= 1, "cos and sin must be fp32 of one shape");
  const int64_t B = embeddings.size(0), C = embeddings.size(1), L = norm_in.size();
  const int64_t D = cos.size(-1);
  TORCH_CHECK(D > 0 && D % 2 == 0 && D <= kMaxHeadDim && B % group == 0 && B > 0, "unsupported head layout");
  const int64_t g = H / H_kv, k = group, U = B / k, n = col + group;
  TORCH_CHECK((int64_t)eps_in.size() == L && (int64_t)w_qkv.size() == L && (int64_t)b_qkv.size() == L &&
                  (int64_t)w_o.size() == L && (int64_t)b_o.size() == L && (int64_t)norm_post.size() == L &&
                  (int64_t)eps_post.size() == L && (int64_t)w_gate_up.size() == L && (int64_t)w_down.size() == L &&
                  (int64_t)keys_t.size() == L && (int64_t)values.size() == L && (int64_t)cache_k.size() == L &&
                  (int64_t)cache_v.size() == L,
              "every per-layer list must have one entry per layer");
  auto is_norm = [&](const Tensor& w) {
    return w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == C;
  };
  TORCH_CHECK(is_norm(norm), "norm weights must be fp32, contiguous, of C elements");
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(is_norm(norm_in[i]) && is_norm(norm_post[i]), "norm weights must be fp32, contiguous, of C elements");
  const int64_t cos_rows = cos.numel() / D;
  TORCH_CHECK(cos_rows == 1 || cos_rows == B, "cos must be (1 | B, 1, D)");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 4 && (bias.size(0) == 1 || bias.size(0) == U) &&
                  bias.size(-2) == k * g && bias.size(-1) >= n && bias.stride(-1) == 1,
              "bias must be fp32 (U | 1, 1, k·g, >= n), contiguous in its last dimension");
  Tensor h = embeddings.contiguous().clone();  // (B, C) fp32: the residual stream, updated in place
  const Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const float* cp = cos_c.data_ptr<float>();
  const float* sp = sin_c.data_ptr<float>();
  const auto bf = h.options().dtype(at::kBFloat16);
  Tensor x = at::empty({B, C}, bf);                          // a norm's output, the projections' input
  Tensor grouped = at::empty({U, H_kv, k * g, D}, h.options());  // the groups' scaled query rows
  Tensor attended = at::empty({B, H * D}, bf);               // attention's output, o's input
  Tensor keys = at::empty({B, H_kv, D}, h.options());        // the step's rotated keys, before keys_to_groups
  Tensor down;  // the previous layer's MLP output (B, C) bf16, added to h by the next norm
  for (int64_t i = 0; i < L; ++i) {
    const Tensor &kt = keys_t[i], &vt = values[i], &ck = cache_k[i], &cv = cache_v[i];
    check_layer_buffers(kt, vt, ck, cv, U, B, H_kv, D, n, pos);
    add_rms_norm_bf16(h.data_ptr<float>(), down.defined() ? down.data_ptr<BFloat16>() : nullptr,
                      norm_in[i].data_ptr<float>(), (float)eps_in[i], x.data_ptr<BFloat16>(), B, C);
    const Tensor qkv = packed_linear(x, w_qkv[i], b_qkv.get(i));  // (B, (H + 2·H_kv)·D) bf16
    TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == at::kBFloat16 && qkv.size(1) == (H + 2 * H_kv) * D,
                "the qkv projection must give (B, (H + 2·H_kv)·D) bf16");
    const auto kts_ = kt.strides(), vts_ = vt.strides();
    TORCH_CHECK(kts_[3] == 1 && vts_[3] == 1, "group buffers must be contiguous in their last dimension");
    const Scatter scatter{H, H_kv, D, g, k, col, pos, (float)scaling, grouped.data_ptr<float>(), keys.data_ptr<float>(),
                          kt.data_ptr<float>(),
                          vt.data_ptr<float>(), ck.data_ptr<float>(), cv.data_ptr<BFloat16>(), kts_,
                          vts_, ck.strides(), cv.strides()};
    const BFloat16* q = qkv.data_ptr<BFloat16>();
    at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {  // rows write disjoint memory
      for (int64_t b = b0; b < b1; ++b)
        scatter.row(b, q + b * qkv.size(1), cp + (cos_rows == 1 ? 0 : b * D), sp + (cos_rows == 1 ? 0 : b * D));
    });
    scatter.keys_to_groups(B);
    // attention per group and KV head: both threads, a pair (u, kv) each at a time
    const int64_t R = k * g, np = (n + 15) / 16 * 16;
    BFloat16* ap = attended.data_ptr<BFloat16>();
    const float* gq = grouped.data_ptr<float>();
    const float* kp = kt.data_ptr<float>();
    const float* vp = vt.data_ptr<float>();
    const float* bp = bias.data_ptr<float>();
    const auto bs = bias.strides();
    const bool bias_per_group = bias.size(0) > 1;
    at::parallel_for(0, U * H_kv, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> scratch(R * np), out(R * D);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t u = p / H_kv, kv = p % H_kv;
        const GroupAttention att{R, D, n, gq + (u * H_kv + kv) * R * D, kp + u * kts_[0] + kv * kts_[1],
                                 vp + u * vts_[0] + kv * vts_[1], bp + (bias_per_group ? u * bs[0] : 0),
                                 kts_[2], vts_[2], bs[2], scratch.data()};
        att.run(out.data());
        for (int64_t j = 0; j < k; ++j)  // row j of group u, query head kv·g + hq -> attended (B, H·D), bf16
          for (int64_t hq = 0; hq < g; ++hq) {
            const float* src = out.data() + (j * g + hq) * D;
            BFloat16* dst = ap + (u * k + j) * (H * D) + (kv * g + hq) * D;
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) store_bf16(dst + d, _mm512_loadu_ps(src + d));
            for (; d < D; ++d) dst[d] = (BFloat16)src[d];
          }
      }
    });
    const Tensor o = packed_linear(attended, w_o[i], b_o.get(i));  // (B, C) bf16
    TORCH_CHECK(o.is_contiguous() && o.scalar_type() == at::kBFloat16 && o.size(0) == B && o.size(1) == C,
                "the o projection must give (B, C) bf16");
    add_rms_norm_bf16(h.data_ptr<float>(), o.data_ptr<BFloat16>(), norm_post[i].data_ptr<float>(), (float)eps_post[i],
                      x.data_ptr<BFloat16>(), B, C);
    const Tensor gate_up = packed_linear(x, w_gate_up[i], std::nullopt);  // (B, 2·I) bf16
    TORCH_CHECK(gate_up.is_contiguous() && gate_up.scalar_type() == at::kBFloat16 && gate_up.size(0) == B &&
                    gate_up.size(1) % 2 == 0, "the gate/up projection must give (B, 2·I) bf16");
    const int64_t I = gate_up.size(1) / 2;
    Tensor act = at::empty({B, I}, bf);
    silu_mul_bf16(gate_up.data_ptr<BFloat16>(), act.data_ptr<BFloat16>(), B, I);
    down = packed_linear(act, w_down[i], std::nullopt);  // (B, C) bf16
    TORCH_CHECK(down.is_contiguous() && down.scalar_type() == at::kBFloat16 && down.size(0) == B && down.size(1) == C,
                "the down projection must give (B, C) bf16");
  }
  add_rms_norm_bf16(h.data_ptr<float>(), down.defined() ? down.data_ptr<BFloat16>() : nullptr, norm.data_ptr<float>(),
                    (float)norm_eps, x.data_ptr<BFloat16>(), B, C);
  return packed_linear(x, w_head, std::nullopt);  // (B, V) bf16
}

// The kernels alone, for tests: rms_norm_bf16(h, w, eps) = add_rms_norm_bf16 without a delta (h unchanged);
// silu_mul_bf16(gate_up) as in the MLP.
Tensor rms_norm_op(const Tensor& h, const Tensor& w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.numel() == h.size(1));
  Tensor copy = h.contiguous().clone(), wc = w.contiguous();
  Tensor out = at::empty(h.sizes(), h.options().dtype(at::kBFloat16));
  add_rms_norm_bf16(copy.data_ptr<float>(), nullptr, wc.data_ptr<float>(), (float)eps, out.data_ptr<BFloat16>(),
                    h.size(0), h.size(1));
  return out;
}

Tensor silu_mul_op(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.size(1) % 2 == 0);
  Tensor in = gate_up.contiguous();
  Tensor out = at::empty({in.size(0), in.size(1) / 2}, in.options());
  silu_mul_bf16(in.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), in.size(0), in.size(1) / 2);
  return out;
}

// Registered without a dispatch key (a catch-all kernel): the packed weights are MkldnnCPU tensors.
TORCH_LIBRARY(ragen_native, m) {
  m.def("decode_grouped(Tensor embeddings, Tensor cos, Tensor sin, Tensor[] norm_in, float[] eps_in, Tensor[] w_qkv, "
        "Tensor?[] b_qkv, Tensor[] w_o, Tensor?[] b_o, Tensor[] norm_post, float[] eps_post, Tensor[] w_gate_up, "
        "Tensor[] w_down, Tensor[] keys_t, Tensor[] values, Tensor[] cache_k, Tensor[] cache_v, Tensor bias, int group, "
        "int col, int pos, int heads, int kv_heads, float scaling, Tensor norm, float norm_eps, Tensor w_head) -> Tensor",
        &decode_grouped);
  m.def("rms_norm_bf16(Tensor h, Tensor w, float eps) -> Tensor", &rms_norm_op);
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor", &silu_mul_op);
}
