// Incremental-decoding kernels of RFA on the CPU.
//
// 1. One causal decoding step, fused: beam gather + decay + update + readout in one pass over each
//    (row, head)'s state, instead of the four to six PyTorch ops (each a full pass over a cold
//    multi-MiB state) of ops/causal_rfa/{recurrent,keys}.py, which are the reference these kernels
//    are tested against (tests/kernels/test_decode_step_cpu.py).
// 2. The random feature map of a few rows (ops/feature_maps.py: normalise, project, sin and cos or
//    relu, scale), one pass instead of about ten small PyTorch ops.
// 3. Cross attention's readout of a decoding step (ops/cross_rfa/state.py), from the summary or
//    the attention form, one pass instead of about ten small PyTorch ops.
//
// All work on fp32; the Python wrappers in __init__.py check and prepare the arguments. For the
// step, ``src`` and ``dst`` are contiguous ``[B, H, F, K + 1]`` buffers; ``order`` (int64 ``[B]``,
// or empty for the identity) says which row of ``src`` each row of ``dst`` continues. Without an
// order ``dst`` may be ``src`` (an update in place).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

// Every loop is compiled twice, for x86-64-v3 (AVX2 + FMA) and for the baseline, and the first
// call picks one by what the CPU supports, so the cached build stays portable and still uses the
// wide units where they exist. (GCC's target_clones("arch=haswell") is not used: its resolver asks
// whether the CPU *is* a Haswell, so an AMD CPU got the baseline.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define RFA_TWO_VERSIONS 1
#endif
#define RFA_INLINE inline __attribute__((always_inline))

namespace {

#ifdef RFA_TWO_VERSIONS
bool cpu_has_v3() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v3");
}
bool use_v3 = cpu_has_v3();
// ``name(params)`` calling ``name_body(args)`` compiled for x86-64-v3 or for the baseline
#define RFA_VERSIONS(ret, name, params, args)                                     \
  __attribute__((target("arch=x86-64-v3"))) ret name##_v3 params { return name##_body args; } \
  ret name##_base params { return name##_body args; }                           \
  ret name params { return use_v3 ? name##_v3 args : name##_base args; }
#else
bool use_v3 = false;
#define RFA_VERSIONS(ret, name, params, args) \
  ret name params { return name##_body args; }
#endif

struct StepArgs {
  int64_t B, H, F, K;
  const int64_t* order;  // nullptr: identity
  const float *q, *k, *v, *log_g;  // log_g nullptr: no gate
  int64_t q0, q1, k0, k1, v0, v1;  // strides of q, k, v [B, H, *] (the last dimension's is 1)
  float eps;
  float* out;
};

StepArgs step_args(const torch::Tensor& dst, const torch::Tensor& order, const torch::Tensor& q,
                   const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& log_g,
                   double eps, torch::Tensor& out) {
  StepArgs a;
  a.B = dst.size(0);
  a.H = dst.size(1);
  a.F = q.size(2);
  a.K = v.size(2);
  a.order = order.numel() ? order.data_ptr<int64_t>() : nullptr;
  if (a.order) {
    for (int64_t b = 0; b < a.B; ++b) {
      TORCH_CHECK(a.order[b] >= 0 && a.order[b] < a.B, "order[", b, "] = ", a.order[b],
                  " is not a row of the state (", a.B, " rows)");
    }
  }
  for (const auto* t : {&q, &k, &v}) TORCH_CHECK(t->stride(2) == 1, "q, k, v need a unit stride in the last dimension");
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.q0 = q.stride(0), a.q1 = q.stride(1), a.k0 = k.stride(0), a.k1 = k.stride(1), a.v0 = v.stride(0), a.v1 = v.stride(1);
  a.log_g = log_g.numel() ? log_g.data_ptr<float>() : nullptr;
  a.eps = static_cast<float>(eps);
  a.out = out.data_ptr<float>();
  return a;
}

// g and 1 - g of one (row, head) from log g (1 and 1 without a gate).
RFA_INLINE void gate_of(const StepArgs& a, int64_t bh, float& g, float& one_minus_g) {
  if (a.log_g) {
    g = std::exp(a.log_g[bh]);
    one_minus_g = -std::expm1(a.log_g[bh]);
  } else {
    g = 1.0f;
    one_minus_g = 1.0f;
  }
}

// out = acc[:K] / max(acc[K], eps): numerator over the guarded denominator (ops/denominator.py)
RFA_INLINE void guarded_ratio(const float* acc, int64_t K, float eps, float* out) {
  const float den = std::max(acc[K], eps);
  for (int64_t j = 0; j < K; ++j) out[j] = acc[j] / den;
}

// the causal step's readout of (row, head) bh
RFA_INLINE void write_ratio(const StepArgs& a, int64_t bh, const float* acc) {
  guarded_ratio(acc, a.K, a.eps, a.out + bh * a.K);
}

RFA_INLINE void summary_rows_body(const StepArgs& a, const float* s_all, float* d_all, int64_t begin,
                                  int64_t end) {
  const int64_t K1 = a.K + 1, state = a.F * K1;
  std::vector<float> acc(K1), v1(K1);
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / a.H, h = bh % a.H;
    const int64_t sb = a.order ? a.order[b] : b;
    const float* s = s_all + (sb * a.H + h) * state;
    float* d = d_all + bh * state;
    const float* q = a.q + b * a.q0 + h * a.q1;
    const float* k = a.k + b * a.k0 + h * a.k1;
    const float* v = a.v + b * a.v0 + h * a.v1;
    float g, one_minus_g;
    gate_of(a, bh, g, one_minus_g);
    for (int64_t j = 0; j < a.K; ++j) v1[j] = v[j] * one_minus_g;
    v1[a.K] = one_minus_g;
    std::fill(acc.begin(), acc.end(), 0.0f);
    float* ac = acc.data();
    const float* vv = v1.data();
    for (int64_t f = 0; f < a.F; ++f) {
      const float* sr = s + f * K1;
      float* dr = d + f * K1;
      const float kf = k[f], qf = q[f];
      if (a.log_g) {
        for (int64_t j = 0; j < K1; ++j) {
          const float x = sr[j] * g + kf * vv[j];
          dr[j] = x;
          ac[j] += qf * x;
        }
      } else {
        for (int64_t j = 0; j < K1; ++j) {
          const float x = sr[j] + kf * vv[j];
          dr[j] = x;
          ac[j] += qf * x;
        }
      }
    }
    write_ratio(a, bh, ac);
  }
}

// sum_f x[f] y[f] in eight independent partial sums, so the compiler can vectorise it
RFA_INLINE float dot(const float* x, const float* y, int64_t n) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t f = 0;
  for (; f + 8 <= n; f += 8) {
    for (int u = 0; u < 8; ++u) part[u] += x[f + u] * y[f + u];
  }
  float total = 0.0f;
  for (; f < n; ++f) total += x[f] * y[f];
  for (int u = 0; u < 8; ++u) total += part[u];
  return total;
}

// The keys of token i for every (row, head) lie next to each other ([n, B, H, W]), the keys of one
// (row, head) are B * H * W apart: so the loop runs over the tokens outside and the (row, head)
// pairs inside, reading and writing the buffers in order (one (row, head) after another, each
// one's readout kept in ``acc``), not jumping a page per key. Each pair sums its keys in token
// order either way.
RFA_INLINE void keys_rows_body(const StepArgs& a, const float* s_all, float* d_all, int64_t length,
                               int64_t begin, int64_t end) {
  const bool gated = a.log_g != nullptr, copy = s_all != d_all;
  const int64_t K1 = a.K + 1, W = a.F + K1 + (gated ? 1 : 0), n = end - begin;
  std::vector<float> acc(n * K1, 0.0f), gates(2 * n);
  for (int64_t bh = begin; bh < end; ++bh) gate_of(a, bh, gates[2 * (bh - begin)], gates[2 * (bh - begin) + 1]);
  for (int64_t i = 0; i < length; ++i) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / a.H, h = bh % a.H;
      const int64_t sb = a.order ? a.order[b] : b;
      const float* q = a.q + b * a.q0 + h * a.q1;
      const float* s = s_all + ((i * a.B + sb) * a.H + h) * W;
      float* d = d_all + ((i * a.B + b) * a.H + h) * W;
      const float w = gated ? s[W - 1] * gates[2 * (bh - begin)] : 1.0f;
      const float score = dot(q, s, a.F) * w;
      const float* vals = s + a.F;
      float* ac = acc.data() + (bh - begin) * K1;
      for (int64_t j = 0; j < K1; ++j) ac[j] += score * vals[j];
      if (copy) std::copy(s, s + a.F + K1, d);
      if (gated) d[W - 1] = w;
    }
  }
  for (int64_t bh = begin; bh < end; ++bh) {  // the new key, then the readout
    const int64_t b = bh / a.H, h = bh % a.H;
    const float* q = a.q + b * a.q0 + h * a.q1;
    float* ac = acc.data() + (bh - begin) * K1;
    float* d = d_all + ((length * a.B + b) * a.H + h) * W;
    const float* k = a.k + b * a.k0 + h * a.k1;
    const float* v = a.v + b * a.v0 + h * a.v1;
    std::copy(k, k + a.F, d);
    float score = dot(q, k, a.F);
    if (gated) {
      const float one_minus_g = gates[2 * (bh - begin) + 1];
      score *= one_minus_g;
      d[W - 1] = one_minus_g;
    }
    for (int64_t j = 0; j < a.K; ++j) {
      d[a.F + j] = v[j];
      ac[j] += score * v[j];
    }
    d[a.F + a.K] = 1.0f;
    ac[a.K] += score;
    write_ratio(a, bh, ac);
  }
}

RFA_VERSIONS(void, summary_rows, (const StepArgs& a, const float* s_all, float* d_all, int64_t begin, int64_t end),
             (a, s_all, d_all, begin, end))
RFA_VERSIONS(void, keys_rows,
             (const StepArgs& a, const float* s_all, float* d_all, int64_t length, int64_t begin, int64_t end),
             (a, s_all, d_all, length, begin, end))

// ---- the random feature map ----

// Beyond this |argument| the reduction below is no longer exact; such rows use std::sin, std::cos.
constexpr float kReducedRange = 8192.0f;

// s = sin(x) * scale, c = cos(x) * scale for n arguments. x = j pi/2 + r with j the nearest
// integer to x / (pi/2) and r in [-pi/4, pi/4], pi/2 split in three parts (Cody and Waite) so that
// j * part is exact for |x| <= kReducedRange; then the minimax polynomials of sin and cos on
// [-pi/4, pi/4] (the coefficients of Cephes' sinf/cosf) and the quadrant j mod 4. Within about
// 1e-7 of the exact values (tests/kernels: against fp64 over [-8192, 8192]), written without
// branches so that the loop is vectorised.
RFA_INLINE void sincos_rows_body(const float* x, float* s, float* c, int64_t n, float scale) {
  float big = 0.0f;
  for (int64_t i = 0; i < n; ++i) big = std::max(big, std::fabs(x[i]));
  if (!(big <= kReducedRange)) {  // also NaN
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::sin(x[i]) * scale;
      c[i] = std::cos(x[i]) * scale;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const float y = xi * 0.63661977236758134f;
    const int j = static_cast<int>(y + (y >= 0.0f ? 0.5f : -0.5f));
    const float jf = static_cast<float>(j);
    float r = xi - jf * 1.5703125f;
    r = r - jf * 4.8375129699707031e-4f;
    r = r - jf * 7.5497899548918821e-8f;
    const float r2 = r * r;
    const float sin_r = r + r * r2 * (-1.6666654611e-1f + r2 * (8.3321608736e-3f + r2 * -1.9515295891e-4f));
    const float cos_r = 1.0f - 0.5f * r2 +
                        r2 * r2 * (4.166664568298827e-2f + r2 * (-1.388731625493765e-3f + r2 * 2.443315711809948e-5f));
    // sin(j pi/2 + r), cos(j pi/2 + r) by the quadrant j mod 4
    const float sv = (j & 1) ? cos_r : sin_r;
    const float cv = (j & 1) ? sin_r : cos_r;
    s[i] = ((j & 2) ? -sv : sv) * scale;
    c[i] = (((j + 1) & 2) ? -cv : cv) * scale;
  }
}

// Eight floats as one value of GCC's vector extensions: one AVX register in the x86-64-v3 loops,
// two SSE registers in the baseline ones. Loaded and stored unaligned.
typedef float v8f __attribute__((vector_size(32)));

RFA_INLINE v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

RFA_INLINE void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof v); }

// out[d] = scale * sum_k x[k] m[k, d] for d < D (m is [K, D] contiguous), reading the rows of m in
// order: N * 8 outputs at a time held in registers, in two partial sums over alternating rows (one
// running sum per output would wait on the latency of every multiply-add).
template <int N>
RFA_INLINE int64_t vecmat_block(const float* x, const float* m, float* out, int64_t K, int64_t D, float scale,
                                int64_t d0) {
  for (; d0 + 8 * N <= D; d0 += 8 * N) {
    v8f even[N], odd[N];
    for (int n = 0; n < N; ++n) even[n] = odd[n] = v8f{};
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      const float* r0 = m + k * D + d0;
      const float* r1 = r0 + D;
      for (int n = 0; n < N; ++n) {
        even[n] += x[k] * load8(r0 + 8 * n);
        odd[n] += x[k + 1] * load8(r1 + 8 * n);
      }
    }
    if (k < K) {
      for (int n = 0; n < N; ++n) even[n] += x[k] * load8(m + k * D + d0 + 8 * n);
    }
    for (int n = 0; n < N; ++n) store8(out + d0 + 8 * n, (even[n] + odd[n]) * scale);
  }
  return d0;
}

RFA_INLINE void vecmat(const float* x, const float* m, float* out, int64_t K, int64_t D, float scale) {
  int64_t d0 = vecmat_block<4>(x, m, out, K, D, scale, 0);
  d0 = vecmat_block<1>(x, m, out, K, D, scale, d0);
  for (; d0 < D; ++d0) {  // the last D mod 8 outputs: a column of m each
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      for (int u = 0; u < 4; ++u) part[u] += x[k + u] * m[(k + u) * D + d0];
    }
    for (; k < K; ++k) part[0] += x[k] * m[k * D + d0];
    out[d0] = ((part[0] + part[1]) + (part[2] + part[3])) * scale;
  }
}

struct FeatureArgs {
  int64_t B, H, T, K, D;
  const float* x;
  int64_t x0, x1, x2;  // strides of x [B, H, T, K] (the last dimension's is 1)
  const float* m;      // [H, K, D]
  bool gaussian;
  float eps, scale;
  float* out;  // [B, H, T, F]
};

// phi of the rows i in [begin, end) taken head-major (i = (h * B + b) * T + t), so that the rows
// sharing a head's [K, D] matrix follow each other and it stays in the L1 cache.
RFA_INLINE void feature_rows_body(const FeatureArgs& a, int64_t begin, int64_t end) {
  const int64_t F = a.gaussian ? 2 * a.D : a.D;
  std::vector<float> proj(a.D);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t h = i / (a.B * a.T), bt = i % (a.B * a.T), b = bt / a.T, t = bt % a.T;
    const float* x = a.x + b * a.x0 + h * a.x1 + t * a.x2;
    const float norm = std::sqrt(dot(x, x, a.K));
    vecmat(x, a.m + h * a.K * a.D, proj.data(), a.K, a.D, 1.0f / (norm + a.eps));
    float* o = a.out + ((b * a.H + h) * a.T + t) * F;
    if (a.gaussian) {
      sincos_rows_body(proj.data(), o, o + a.D, a.D, a.scale);
    } else {
      for (int64_t d = 0; d < a.D; ++d) o[d] = std::max(proj[d], 0.0f) * a.scale;
    }
  }
}

RFA_VERSIONS(void, feature_rows, (const FeatureArgs& a, int64_t begin, int64_t end), (a, begin, end))
RFA_VERSIONS(void, sincos_rows, (const float* x, float* s, float* c, int64_t n, float scale), (x, s, c, n, scale))

// ---- cross attention's readout ----

struct CrossArgs {
  int64_t B, H, T, F, K, S, beams;  // S source positions (attention form) or 0 (summary)
  const float* q;                   // [B, H, T, F] through its strides
  int64_t q0, q1, q2;
  const float* kT;  // attention form: phi(K)^T [Bs, H, F, S] and [V | 1] [Bs, H, S, K + 1]
  const float* v1;
  const float* Sz;  // summary: [Bs, H, F, K + 1]
  float eps;
  float* out;  // [B, H, T, K]
};

// For the query rows i in [begin, end) (i = (b * H + h) * T + t), read from the state of source
// b / beams: phi(q) [S | z] (summary), or (phi(q) phi(K)^T) [V | 1] (attention form), as
// numerator / max(denominator, eps).
RFA_INLINE void cross_rows_body(const CrossArgs& a, int64_t begin, int64_t end) {
  const int64_t K1 = a.K + 1;
  std::vector<float> acc(K1), scores(a.S);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = i % a.T, bh = i / a.T, b = bh / a.H, h = bh % a.H;
    const int64_t sh = (b / a.beams) * a.H + h;
    const float* q = a.q + b * a.q0 + h * a.q1 + t * a.q2;
    if (a.S == 0) {
      vecmat(q, a.Sz + sh * a.F * K1, acc.data(), a.F, K1, 1.0f);  // phi(q) [S | z]
    } else {
      vecmat(q, a.kT + sh * a.F * a.S, scores.data(), a.F, a.S, 1.0f);  // phi(q) phi(K)^T
      vecmat(scores.data(), a.v1 + sh * a.S * K1, acc.data(), a.S, K1, 1.0f);  // ... [V | 1]
    }
    guarded_ratio(acc.data(), a.K, a.eps, a.out + i * a.K);
  }
}

RFA_VERSIONS(void, cross_rows, (const CrossArgs& a, int64_t begin, int64_t end), (a, begin, end))

}  // namespace

// The summary form: Sz' = g Sz[order] + phi(k) [(1 - g) v | 1 - g]^T, out = phi(q) Sz' as
// numerator / max(denominator, eps). Returns out [B, H, K].
torch::Tensor summary_step(const torch::Tensor& src, torch::Tensor dst, const torch::Tensor& order,
                           const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& log_g, double eps) {
  auto out = torch::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  const StepArgs a = step_args(dst, order, q, k, v, log_g, eps, out);
  at::parallel_for(0, a.B * a.H, 1, [&](int64_t begin, int64_t end) {
    summary_rows(a, src.data_ptr<float>(), dst.data_ptr<float>(), begin, end);
  });
  return out;
}

// The attention form (ops/causal_rfa/keys.py): ``length`` key rows [phi(k_i) | v_i | 1 (| w_i)]
// held in the buffers as [n, B, H, W]. Copies the rows in use from src[:, order] to dst (each
// gate weight times g), appends row ``length`` = [phi(k) | v | 1 (| 1 - g)] and reads out
// sum_i (phi(q) . phi(k_i)) w_i [v_i | 1] as numerator / max(denominator, eps).
torch::Tensor keys_step(const torch::Tensor& src, torch::Tensor dst, const torch::Tensor& order,
                        int64_t length, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& log_g, double eps) {
  auto out = torch::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  const StepArgs a = step_args(dst, order, q, k, v, log_g, eps, out);
  const bool gated = a.log_g != nullptr;
  const int64_t K1 = a.K + 1, W = a.F + K1 + (gated ? 1 : 0);
  TORCH_CHECK(length >= 0 && (length + 1) * a.B * a.H * W <= dst.numel(), "the attention form of a [",
              a.B, ", ", a.H, ", ", a.F, ", ", K1, "] buffer holds at most ", dst.numel() / (a.B * a.H * W),
              " keys; got token ", length);
  at::parallel_for(0, a.B * a.H, 1, [&](int64_t begin, int64_t end) {
    keys_rows(a, src.data_ptr<float>(), dst.data_ptr<float>(), length, begin, end);
  });
  return out;
}

// phi(x) of ops/feature_maps.py for x [B, H, T, K] (unit stride in the last dimension) and the
// prepared matrix m [H, K, D] (sigma folded in, see projection_matrix): the rows normalised to
// x / (|x| + eps), projected, then D^-1/2 [sin, cos] (gaussian) or D^-1/2 max(0, .) (arccos).
torch::Tensor feature_map(const torch::Tensor& x, const torch::Tensor& m, bool gaussian, double eps) {
  TORCH_CHECK(x.dim() == 4 && m.dim() == 3 && x.size(1) == m.size(0) && x.size(3) == m.size(1),
              "x [B, H, T, K] and the matrix [H, K, D] do not match: ", x.sizes(), " and ", m.sizes());
  TORCH_CHECK(x.stride(3) == 1 && m.is_contiguous(), "x needs a unit stride in the last dimension, m contiguous");
  FeatureArgs a;
  a.B = x.size(0), a.H = x.size(1), a.T = x.size(2), a.K = x.size(3), a.D = m.size(2);
  auto out = torch::empty({a.B, a.H, a.T, gaussian ? 2 * a.D : a.D}, x.options());
  a.x = x.data_ptr<float>();
  a.x0 = x.stride(0), a.x1 = x.stride(1), a.x2 = x.stride(2);
  a.m = m.data_ptr<float>();
  a.gaussian = gaussian;
  a.eps = static_cast<float>(eps);
  a.scale = 1.0f / std::sqrt(static_cast<float>(a.D));
  a.out = out.data_ptr<float>();
  at::parallel_for(0, a.B * a.H * a.T, 16, [&](int64_t begin, int64_t end) { feature_rows(a, begin, end); });
  return out;
}

// Cross attention's readout for q [B, H, T, F] (unit stride in the last dimension) from the
// state of B / beams sources: the summary Sz [Bs, H, F, K + 1] (kT and v1 empty), or the attention
// form kT [Bs, H, F, S], v1 [Bs, H, S, K + 1] (Sz empty), all contiguous. Returns [B, H, T, K].
torch::Tensor cross_readout(const torch::Tensor& q, const torch::Tensor& Sz, const torch::Tensor& kT,
                            const torch::Tensor& v1, int64_t beams, double eps) {
  CrossArgs a;
  const bool summary = Sz.numel() > 0;
  const torch::Tensor& values = summary ? Sz : v1;
  a.B = q.size(0), a.H = q.size(1), a.T = q.size(2), a.F = q.size(3), a.K = values.size(3) - 1;
  a.S = summary ? 0 : kT.size(3);
  a.beams = beams;
  TORCH_CHECK(beams >= 1 && a.B == values.size(0) * beams, q.size(0), " query rows do not share ",
              values.size(0), " sources ", beams, " by ", beams);
  TORCH_CHECK(q.stride(3) == 1, "q needs a unit stride in the last dimension");
  auto out = torch::empty({a.B, a.H, a.T, a.K}, q.options());
  a.q = q.data_ptr<float>();
  a.q0 = q.stride(0), a.q1 = q.stride(1), a.q2 = q.stride(2);
  a.Sz = summary ? Sz.data_ptr<float>() : nullptr;
  a.kT = summary ? nullptr : kT.data_ptr<float>();
  a.v1 = summary ? nullptr : v1.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.out = out.data_ptr<float>();
  at::parallel_for(0, a.B * a.H * a.T, 4, [&](int64_t begin, int64_t end) { cross_rows(a, begin, end); });
  return out;
}

// sin(x) * scale, cos(x) * scale of the kernels' own sin/cos, for the tests
std::vector<torch::Tensor> sincos_scaled(const torch::Tensor& x, double scale) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 1, "x must be a contiguous fp32 vector");
  auto s = torch::empty_like(x), c = torch::empty_like(x);
  sincos_rows(x.data_ptr<float>(), s.data_ptr<float>(), c.data_ptr<float>(), x.numel(), static_cast<float>(scale));
  return {s, c};
}

// Which version of the loops runs: "x86-64-v3" or "baseline"; set_simd("baseline") forces the
// baseline (the tests check both), set_simd("x86-64-v3") goes back where the CPU has it.
std::string simd() { return use_v3 ? "x86-64-v3" : "baseline"; }

void set_simd(const std::string& level) {
  if (level == "baseline") {
    use_v3 = false;
    return;
  }
  TORCH_CHECK(level == "x86-64-v3", "simd level must be 'x86-64-v3' or 'baseline', got '", level, "'");
#ifdef RFA_TWO_VERSIONS
  TORCH_CHECK(cpu_has_v3(), "this CPU does not support x86-64-v3");
  use_v3 = true;
#else
  TORCH_CHECK(false, "this build has only the baseline loops");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("summary_step", &summary_step, "fused causal RFA decoding step on the summary [S | z]");
  m.def("keys_step", &keys_step, "fused causal RFA decoding step in the attention form");
  m.def("feature_map", &feature_map, "random feature map of a few rows (fp32)");
  m.def("cross_readout", &cross_readout, "cross attention's readout from the summary or the attention form");
  m.def("sincos_scaled", &sincos_scaled, "the kernels' sin and cos, times scale");
  m.def("simd", &simd, "which version of the loops runs");
  m.def("set_simd", &set_simd, "force the baseline loops, or go back to x86-64-v3");
}
