// One incremental-decoding step of causal RFA on the CPU, fused: beam gather + decay + update +
// readout in one pass over each (row, head)'s state, instead of the four to six PyTorch ops (each
// a full pass over a cold multi-MiB state) of ops/causal_rfa/{recurrent,keys}.py, which are the
// reference these kernels are tested against (tests/kernels/test_decode_step_cpu.py).
//
// Both work on fp32, contiguous tensors; the Python wrappers in __init__.py check and prepare
// the arguments. ``src`` and ``dst`` are ``[B, H, F, K + 1]`` buffers; ``order`` (int64 ``[B]``,
// or empty for the identity) says which row of ``src`` each row of ``dst`` continues. Without an
// order ``dst`` may be ``src`` (an update in place).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

// AVX2 + FMA and baseline versions of the loops, chosen when the library loads (GCC's function
// multi-versioning), so the build stays portable and still uses the wide units where they exist.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RFA_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define RFA_CLONES
#endif

namespace {

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
inline void gate_of(const StepArgs& a, int64_t bh, float& g, float& one_minus_g) {
  if (a.log_g) {
    g = std::exp(a.log_g[bh]);
    one_minus_g = -std::expm1(a.log_g[bh]);
  } else {
    g = 1.0f;
    one_minus_g = 1.0f;
  }
}

// out = acc[:K] / max(acc[K], eps)
inline void write_ratio(const StepArgs& a, int64_t bh, const float* acc) {
  const float den = std::max(acc[a.K], a.eps);
  float* o = a.out + bh * a.K;
  for (int64_t j = 0; j < a.K; ++j) o[j] = acc[j] / den;
}

RFA_CLONES void summary_rows(const StepArgs& a, const float* s_all, float* d_all, int64_t begin, int64_t end) {
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
inline float dot(const float* x, const float* y, int64_t n) {
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

RFA_CLONES void keys_rows(const StepArgs& a, const float* s_all, float* d_all, int64_t length, int64_t begin,
                          int64_t end) {
  const bool gated = a.log_g != nullptr, copy = s_all != d_all;
  const int64_t K1 = a.K + 1, W = a.F + K1 + (gated ? 1 : 0);
  std::vector<float> acc(K1);
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / a.H, h = bh % a.H;
    const int64_t sb = a.order ? a.order[b] : b;
    const float* q = a.q + b * a.q0 + h * a.q1;
    float g, one_minus_g;
    gate_of(a, bh, g, one_minus_g);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float* ac = acc.data();
    for (int64_t i = 0; i < length; ++i) {
      const float* s = s_all + ((i * a.B + sb) * a.H + h) * W;
      float* d = d_all + ((i * a.B + b) * a.H + h) * W;
      const float w = gated ? s[W - 1] * g : 1.0f;
      const float score = dot(q, s, a.F) * w;
      const float* vals = s + a.F;
      for (int64_t j = 0; j < K1; ++j) ac[j] += score * vals[j];
      if (copy) std::copy(s, s + a.F + K1, d);
      if (gated) d[W - 1] = w;
    }
    // the new key
    float* d = d_all + ((length * a.B + b) * a.H + h) * W;
    const float* k = a.k + b * a.k0 + h * a.k1;
    const float* v = a.v + b * a.v0 + h * a.v1;
    std::copy(k, k + a.F, d);
    float score = dot(q, k, a.F);
    if (gated) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("summary_step", &summary_step, "fused causal RFA decoding step on the summary [S | z]");
  m.def("keys_step", &keys_step, "fused causal RFA decoding step in the attention form");
}
