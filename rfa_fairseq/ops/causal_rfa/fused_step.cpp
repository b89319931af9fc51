// One decoding step of causal RFA in one pass over the state (float32, CPU): for each row r and head h,
//   new[r, h] = decay[r, h] * old[parents[r], h] + k[r, h] (x) v1[r, h]      (F x (K + 1))
//   out[r, h] = q[r, h] . new[r, h]                                          (K + 1: numerator | denominator)
// The beam's reorder, the decay, the update and the read-out each read the state once in torch's operators; here
// it is read once and written once. The reference: recurrent.py's recurrent_causal_rfa_step after an index_select.
#include <torch/extension.h>
#include <ATen/Parallel.h>

torch::Tensor step(const torch::Tensor& old, torch::Tensor& next, const torch::Tensor& parents, const torch::Tensor& q,
                   const torch::Tensor& k, const torch::Tensor& v1, const torch::Tensor& decay) {
  const int64_t R = next.size(0), H = next.size(1), F = next.size(2), C = next.size(3);
  TORCH_CHECK(old.is_contiguous() && next.is_contiguous() && q.is_contiguous() && k.is_contiguous() &&
              v1.is_contiguous() && decay.is_contiguous() && parents.is_contiguous(), "fused step: contiguous inputs");
  TORCH_CHECK(parents.numel() == R && q.numel() == R * H * F && k.numel() == R * H * F && v1.numel() == R * H * C &&
              decay.numel() == R * H && old.size(1) == H && old.size(2) == F && old.size(3) == C, "fused step: shapes");
  auto out = torch::zeros({R, H, C}, q.options());
  const float* __restrict__ src = old.data_ptr<float>();
  float* __restrict__ dst = next.data_ptr<float>();
  const int64_t* P = parents.data_ptr<int64_t>();
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v1.data_ptr<float>(), *G = decay.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t rows = old.size(0);
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(P[r] >= 0 && P[r] < rows, "fused step: a parent out of range");
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict__ s = src + (P[i / H] * H + i % H) * F * C;
      float* __restrict__ d = dst + i * F * C;
      const float* __restrict__ v = V + i * C;
      float* __restrict__ o = O + i * C;
      const float g = G[i];
      for (int64_t f = 0; f < F; ++f) {
        const float kf = K[i * F + f], qf = Q[i * F + f];
        for (int64_t c = 0; c < C; ++c) {
          const float x = g * s[f * C + c] + kf * v[c];
          d[f * C + c] = x;
          o[c] += qf * x;
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("step", &step, "causal RFA's decoding step in one pass"); }
