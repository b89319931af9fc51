// An RFA decoder's decoding step as compiled layers (on the CPU, C++ through torch's extension API): one call
// runs the whole step, the token embedding to the output scores. Each block is the fused form of one module's step,
// and that module is its reference (tests/engines/test_compiled_step.py):
//   causal RFA (CausalRFAttention._step): one product for q, k, v and the gate; then per row and head one pass that
//     maps q and k to their features, gathers the parent's state, decays and updates it and reads it out;
//   softmax cross attention (SoftmaxCrossAttention): the cached keys and values of the whole source, or of the
//     sentence window's span (--cross-sentence-window);
//   RFA cross attention (CrossRFAttention): the features of q read from the source's state;
//   the FFN, the residuals and layer norms (fairseq's TransformerDecoderLayerBase), the output projection.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <unordered_map>
#include <vector>

using torch::Tensor;
using Weights = std::unordered_map<std::string, Tensor>;
using Numbers = std::unordered_map<std::string, double>;

namespace {

Tensor weight(const Weights& w, const std::string& name) {
  auto it = w.find(name);
  TORCH_CHECK(it != w.end() && it->second.scalar_type() == torch::kFloat, "compiled step: no float32 weight ", name);
  return it->second.contiguous();
}

Tensor optional_weight(const Weights& w, const std::string& name) {
  return w.count(name) ? weight(w, name) : Tensor();
}

double number(const Numbers& n, const std::string& name) {
  auto it = n.find(name);
  TORCH_CHECK(it != n.end(), "compiled step: no setting ", name);
  return it->second;
}

// term(0) o ... o term(n - 1) for o = combine (+, max: zero its identity here) in 16 lanes of partial results (one
// AVX-512 vector, two AVX2 ones): a compiler keeps a float sum's order, so a single running sum would not vectorize
template <typename Term, typename Combine = std::plus<float>>
inline float lanes(int64_t n, Term&& term, Combine&& combine = Combine()) {
  constexpr int64_t L = 16;
  float partial[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int64_t l = 0; l < L; ++l) partial[l] = combine(partial[l], term(i + l));
  float total = 0.f;
  for (; i < n; ++i) total = combine(total, term(i));
  for (int64_t l = 0; l < L; ++l) total = combine(total, partial[l]);
  return total;
}

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  return lanes(n, [&](int64_t i) { return a[i] * b[i]; });
}

inline float largest(const float* __restrict__ a, int64_t n) {  // max |a|
  return lanes(n, [&](int64_t i) { return std::fabs(a[i]); }, [](float x, float y) { return std::max(x, y); });
}

// y [R, N] = x [R, C] w^T + b in float32, reading each weight once for all rows: at a few rows ATen's product (MKL)
// spends more time packing the weight, on every call, than multiplying.
void float_product(const float* x, int64_t R, int64_t C, const float* w, const float* b, int64_t N, float* y) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t r = 0; r < R; ++r) y[r * N + n] = dot(x + r * C, w + n * C, C) + b[n];
  });
}

// Up to this many rows a float32 product is float_product's, from it ATen's (MKL's packing then pays for itself).
// The int8 loop's rows held in registers at a time.
constexpr int64_t FEW_ROWS = 4;

// An int8 weight [N, C] as the int8 loop reads it: blocks of BLOCK outputs (one vector of int32 sums), in each the
// outputs' groups of 4 consecutive inputs side by side ([N / BLOCK, C / 4, BLOCK, 4], N and C padded with zeros),
// so that one step adds a group's 4 products to BLOCK outputs' sums: AVX-512 VNNI's one instruction for 16 outputs;
// AVX2 (8 outputs) sums u8 x s8 pairs in 16 bits, exact as the inputs have 7 bits there (reduce_range), then pairs of
// those in 32 (a CPU with neither builds no compiled step: the eager one runs). R rows take the loop up to OWN_MACS
// products (R N C; FEW_ROWS rows always), oneDNN above (measured, one thread; its call alone costs some 20 us).
constexpr int64_t GROUP = 4;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t BLOCK = 16, OWN_MACS = int64_t(1) << 22;  // AMX's and VNNI's kernels gain past some 4M
using Sums = __m512i;
inline Sums load_block(const int8_t* w) { return _mm512_loadu_si512(w); }
inline Sums add_four(Sums s, int32_t four, Sums w) { return _mm512_dpbusd_epi32(s, _mm512_set1_epi32(four), w); }
inline void store_sums(int32_t* to, Sums s) { _mm512_storeu_si512(to, s); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int64_t BLOCK = 8, OWN_MACS = int64_t(1) << 27;  // oneDNN's AVX2 kernel gains at no size measured
using Sums = __m256i;
inline Sums load_block(const int8_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
inline Sums add_four(Sums s, int32_t four, Sums w) {
  const Sums pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(four), w);
  return _mm256_add_epi32(s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline void store_sums(int32_t* to, Sums s) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), s); }
#else
#error "the compiled step needs AVX2 (with F16C and FMA) or AVX-512 VNNI"
#endif

Tensor int8_layout(const Tensor& w8) {
  const int64_t N = w8.size(0), C = w8.size(1), blocks = (N + BLOCK - 1) / BLOCK, groups = (C + GROUP - 1) / GROUP;
  Tensor padded = at::zeros({blocks * BLOCK, groups * GROUP}, w8.options());
  padded.narrow(0, 0, N).narrow(1, 0, C).copy_(w8);
  return padded.view({blocks, BLOCK, groups, GROUP}).permute({0, 2, 1, 3}).contiguous();
}

// sums [chunks x FEW_ROWS, blocks x BLOCK] (int32) of x [chunks x FEW_ROWS, groups x 4] (u8, its rows padded with
// zeros; the rows past the input's zeros) by a weight in the loop's layout, FEW_ROWS rows at a time (a count known to
// the compiler keeps the sums in registers), each block of the weight read from memory once for all rows
void int8_loop(const uint8_t* x, int64_t chunks, int64_t groups, const int8_t* w, int64_t blocks, int32_t* sums) {
  const int64_t width = groups * GROUP, outputs = blocks * BLOCK;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* block = w + n * groups * BLOCK * GROUP;
      for (int64_t first = 0; first < chunks * FEW_ROWS; first += FEW_ROWS) {
        Sums lanes[FEW_ROWS] = {};  // zeros
        for (int64_t g = 0; g < groups; ++g) {
          const Sums weights = load_block(block + g * BLOCK * GROUP);
          for (int64_t r = 0; r < FEW_ROWS; ++r) {
            int32_t four;  // the row's group of 4 inputs, in every lane
            std::memcpy(&four, x + (first + r) * width + g * GROUP, GROUP);
            lanes[r] = add_four(lanes[r], four, weights);
          }
        }
        for (int64_t r = 0; r < FEW_ROWS; ++r) store_sums(sums + (first + r) * outputs + n * BLOCK, lanes[r]);
      }
    }
  });
}

// Whether int8 products quantize their inputs to 7 bits: without AVX-512 VNNI (in this build, for -march=native),
// AVX2 sums pairs of 8-bit products in saturating 16 bits (torch's dynamic quantized Linear does the same).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
bool reduce_range() { return false; }
#else
bool reduce_range() { return true; }
#endif

// A product by a weight matrix [N, C] and its bias [N] (or none): float32, or int8 weights by oneDNN (torch's
// onednn::qlinear_prepack, packed once, and onednn::qlinear_pointwise: AMX, VNNI or AVX2 as the CPU has). The weight
// is quantized per output, the input per call and row (u8 about a zero point of 128, the row's largest magnitude at
// 127; 64 and 63 in 7 bits), the int32 sums scaled back per output and row, so that a row's outputs do not depend on
// the other rows (another sentence of the batch, another beam). Where it pays, int8_loop (OWN_MACS).
struct Linear {
  Tensor w, b;  // float32 [N, C], [N]; w undefined where int8
  Tensor packed, scale, zero;  // int8: oneDNN's weight, its scale per output [N] (float32), zero points [N] (0)
  Tensor blocked, sums;  // int8: the weight in int8_loop's layout, its rows' sums [N] (int32)
  mutable std::vector<uint8_t> loop_in;  // int8_loop's input and sums, kept from call to call
  mutable std::vector<int32_t> loop_sums;
  Linear() = default;
  Linear(const Tensor& weight_, const Tensor& bias, bool int8)  // no bias: zeros
      : w(weight_), b(bias.defined() ? bias : at::zeros({weight_.size(0)}, weight_.options())) {
    if (!int8) return;
    static auto prepack = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_prepack", "");
    scale = w.abs().amax(1).div(127.0).clamp_min(1e-12);
    zero = at::zeros({w.size(0)}, w.options().dtype(torch::kLong));
    Tensor w8 = w.div(scale.unsqueeze(1)).round().to(torch::kChar);
    blocked = int8_layout(w8), sums = w8.sum({1}, false, torch::kInt);
    torch::jit::Stack stack{w8, c10::IValue()};
    prepack.callBoxed(&stack);
    packed = stack.at(0).toTensor();
    w = Tensor();  // only the packed copy is read
  }
  bool defined() const { return w.defined() || packed.defined(); }
  Tensor operator()(const Tensor& x) const {  // [R, C] -> [R, N]
    TORCH_CHECK(x.is_contiguous(), "compiled step: a product of a strided input");
    if (packed.defined()) return int8_product(x);
    if (x.size(0) > FEW_ROWS) return at::addmm(b, x, w.t());
    Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    float_product(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), b.data_ptr<float>(), w.size(0),
                  y.data_ptr<float>());
    return y;
  }

 private:
  Tensor int8_product(const Tensor& x) const {
    static auto product = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "")
        .typed<Tensor(Tensor, double, int64_t, Tensor, Tensor, Tensor, std::optional<Tensor>, double, int64_t,
                      std::optional<c10::ScalarType>, c10::string_view, torch::List<std::optional<at::Scalar>>,
                      c10::string_view)>();
    const int64_t ZERO = reduce_range() ? 64 : 128;  // 7 bits: u8 at most 127
    const float top = ZERO - 1;
    const int64_t R = x.size(0), C = x.size(1), N = scale.size(0);
    const bool own = R <= FEW_ROWS || R * N * C <= OWN_MACS;
    const int64_t width = own ? blocked.size(1) * GROUP : C;  // int8_loop reads rows padded with zeros
    const int64_t chunks = (R + FEW_ROWS - 1) / FEW_ROWS;
    Tensor q = own ? Tensor() : at::empty({R, C}, x.options().dtype(torch::kByte));
    if (own) {  // the rows from R on zeros (the padding past C stays zero: it is never written)
      loop_in.resize(chunks * FEW_ROWS * width);
      std::fill(loop_in.begin() + R * width, loop_in.end(), 0);
    }
    std::vector<float> row_scale(R);
    const float* in = x.data_ptr<float>();
    uint8_t* out = own ? loop_in.data() : q.data_ptr<uint8_t>();
    for (int64_t r = 0; r < R; ++r) {
      row_scale[r] = std::max(largest(in + r * C, C), 1e-30f) / top;
      const float inverse = 1.f / row_scale[r];
      for (int64_t c = 0; c < C; ++c) out[r * width + c] = uint8_t(std::nearbyint(in[r * C + c] * inverse) + ZERO);
    }
    const float* __restrict__ bias = b.data_ptr<float>();
    if (own) {
      const int64_t outputs = blocked.size(0) * BLOCK;
      loop_sums.resize(chunks * FEW_ROWS * outputs);
      int8_loop(out, chunks, blocked.size(1), blocked.data_ptr<int8_t>(), blocked.size(0), loop_sums.data());
      Tensor y = at::empty({R, N}, x.options());
      const int32_t* __restrict__ S = sums.data_ptr<int32_t>();
      const float* __restrict__ ws = scale.data_ptr<float>();
      for (int64_t r = 0; r < R; ++r) {  // the zero point's share taken out, then scaled per output and row
        const int32_t* __restrict__ t = loop_sums.data() + r * outputs;
        float* __restrict__ p = y.data_ptr<float>() + r * N;
        for (int64_t n = 0; n < N; ++n)
          p[n] = static_cast<float>(t[n] - static_cast<int32_t>(ZERO) * S[n]) * ws[n] * row_scale[r] + bias[n];
      }
      return y;
    }
    Tensor y = product.call(q, 1.0, ZERO, packed, scale, zero, std::nullopt, 1.0, 0, torch::kFloat, "none",
                            torch::List<std::optional<at::Scalar>>(), "");
    for (int64_t r = 0; r < R; ++r) {
      float* __restrict__ p = y.data_ptr<float>() + r * N;
      for (int64_t n = 0; n < N; ++n) p[n] = p[n] * row_scale[r] + bias[n];
    }
    return y;
  }
};

Linear linear(const Weights& w, const std::string& name, int64_t int8_min_weights) {
  Tensor m = weight(w, name + ".weight");
  return Linear(m, optional_weight(w, name + ".bias"), int8_min_weights >= 0 && m.numel() >= int8_min_weights);
}

// fairseq's LayerNorm (torch's), of x + residual when residual is given, in place in x [R, C].
struct Norm {
  Tensor w, b;
  float eps = 1e-5f;
  void operator()(Tensor& x, const Tensor* residual = nullptr) const {
    const int64_t R = x.size(0), C = x.size(1);
    float* p = x.data_ptr<float>();
    const float* add = residual ? residual->data_ptr<float>() : nullptr;
    const float *g = w.data_ptr<float>(), *h = b.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
      float* row = p + r * C;
      if (add)
        for (int64_t c = 0; c < C; ++c) row[c] += add[r * C + c];
      const float m = lanes(C, [&](int64_t c) { return row[c]; }) / C;
      const float var = lanes(C, [&](int64_t c) { return (row[c] - m) * (row[c] - m); }) / C;
      const float inv = 1.f / std::sqrt(var + eps);
      for (int64_t c = 0; c < C; ++c) row[c] = (row[c] - m) * inv * g[c] + h[c];
    }
  }
};

Norm norm(const Weights& w, const Numbers& n, const std::string& name) {
  return Norm{weight(w, name + ".weight"), weight(w, name + ".bias"), static_cast<float>(number(n, name + ".eps"))};
}

// The gaussian kernel's features of x [R, H, K] (RandomFeatureMap.forward at inference): x / (|x| + 1e-6) by the
// projection [H, K, D] (sigma folded in), then [sin | cos] / sqrt(D): [R, H, 2 D]; the sines and cosines by ATen
// (vectorized), as sin(a) and sin(a + pi / 2) as in ops.gaussian_step_features.
Tensor gaussian_features(const Tensor& x, const Tensor& projection) {
  const int64_t R = x.size(0), H = x.size(1), K = x.size(2), D = projection.size(2);
  Tensor angles = at::empty({R, H, 2 * D}, x.options());
  const float *px = x.data_ptr<float>(), *pw = projection.data_ptr<float>();
  float* pa = angles.data_ptr<float>();
  const float half_pi = static_cast<float>(M_PI / 2);
  for (int64_t i = 0; i < R * H; ++i) {
    const float* __restrict__ u = px + i * K;
    const float* __restrict__ w = pw + (i % H) * K * D;
    float* __restrict__ a = pa + i * 2 * D;
    const float scale = 1.f / (std::sqrt(dot(u, u, K)) + 1e-6f);
    constexpr int64_t L = 16;  // features summed at a time, their sums in registers
    int64_t d0 = 0;
    for (; d0 + L <= D; d0 += L) {
      float sums[L] = {};
      for (int64_t k = 0; k < K; ++k)
        for (int64_t l = 0; l < L; ++l) sums[l] += u[k] * scale * w[k * D + d0 + l];
      std::copy(sums, sums + L, a + d0);
    }
    for (int64_t d = d0; d < D; ++d) a[d] = lanes(K, [&](int64_t k) { return u[k] * scale * w[k * D + d]; });
    for (int64_t d = 0; d < D; ++d) a[D + d] = a[d] + half_pi;
  }
  return angles.sin_().mul_(1.f / std::sqrt(static_cast<float>(D)));
}

// One (f) row of a head's causal state advanced and read out: d = decay s + k_f v1 over the V = K + 1 numbers (value |
// 1), o += q_f d. The state in float32, or in float16 (half the bytes each step reads and writes; F16C's conversions,
// rounded to nearest, the read-out from the unrounded sums).
inline void advance(const float* __restrict__ s, float* __restrict__ d, const float* v1, float decay, float kf,
                    float qf, float* o, int64_t V) {
  for (int64_t c = 0; c < V; ++c) {
    const float value = decay * s[c] + kf * v1[c];
    d[c] = value;
    o[c] += qf * value;
  }
}

inline void advance(const at::Half* __restrict__ s, at::Half* __restrict__ d, const float* v1, float decay, float kf,
                    float qf, float* o, int64_t V) {
  const __m256 decays = _mm256_set1_ps(decay), kfs = _mm256_set1_ps(kf), qfs = _mm256_set1_ps(qf);
  int64_t c = 0;
  for (; c + 8 <= V; c += 8) {
    const __m256 old = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c)));
    const __m256 value = _mm256_fmadd_ps(decays, old, _mm256_mul_ps(kfs, _mm256_loadu_ps(v1 + c)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + c), _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(qfs, value, _mm256_loadu_ps(o + c)));
  }
  for (; c < V; ++c) {
    const float value = decay * static_cast<float>(s[c]) + kf * v1[c];
    d[c] = at::Half(value);
    o[c] += qf * value;
  }
}

// Causal RFA's step (CausalRFAttention._step): the parents' gather, decay, update and read-out in one pass.
struct CausalRFA {
  Linear in, out;
  Tensor projection;  // [H, K, D]
  int64_t H = 0;
  bool gated = false, convex = true;
  float eps = 0.01f;

  // x [R, C], pad [R] (or undefined), the state of the previous step's rows old [P, H, F, K + 1] read at parents
  // [R], the advanced state written into next [R, H, F, K + 1]: the block's output [R, C] (before its residual).
  Tensor operator()(const Tensor& x, const Tensor& pad, const Tensor& old, Tensor& next, const Tensor& parents) const {
    const int64_t R = x.size(0), C = x.size(1), K = C / H, F = next.size(2), V = K + 1;
    TORCH_CHECK(next.size(0) == R && next.size(1) == H && next.size(3) == V && old.size(1) == H &&
                    old.size(2) == F && old.size(3) == V && old.is_contiguous() && next.is_contiguous() &&
                    F == 2 * projection.size(2), "compiled step: a causal state of another layout");
    Tensor y = in(x);  // [R, 3 C (+ H)]: q | k | v | the gate's logit
    Tensor qk = y.narrow(1, 0, 2 * C).reshape({R * 2, H, K});
    Tensor phi = gaussian_features(qk, projection).view({R, 2, H, F});
    Tensor heads = at::empty({R, H, K}, x.options());
    const float *Y = y.data_ptr<float>(), *PHI = phi.data_ptr<float>();
    const bool *is_pad = pad.defined() ? pad.data_ptr<bool>() : nullptr;
    const int64_t* P = parents.data_ptr<int64_t>();
    float* O = heads.data_ptr<float>();
    const int64_t width = y.size(1), rows = old.size(0);
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(P[r] >= 0 && P[r] < rows, "compiled step: a parent out of range");
    const bool half = old.scalar_type() == torch::kHalf;
    TORCH_CHECK(next.scalar_type() == old.scalar_type() && (half || old.scalar_type() == torch::kFloat),
                "compiled step: a causal state neither float32 nor float16");
    auto pass = [&](auto* src, auto* dst) { at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> v1(V), o(V);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / H, h = i % H;
        const bool skip = is_pad && is_pad[r];  // a pad neither writes nor decays the state
        float decay = 1.f, write = skip ? 0.f : 1.f;
        if (gated && !skip) {
          const float logit = Y[r * width + 3 * C + h];
          decay = 1.f / (1.f + std::exp(-logit));
          if (convex) write = 1.f / (1.f + std::exp(logit));  // 1 - g without cancellation
        }
        for (int64_t c = 0; c < K; ++c) v1[c] = Y[r * width + 2 * C + h * K + c] * write;
        v1[K] = write;
        const float* q = PHI + (r * 2 * H + h) * F;
        const float* k = PHI + (r * 2 * H + H + h) * F;
        const auto* s = src + (P[r] * H + h) * F * V;
        auto* d = dst + i * F * V;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t f = 0; f < F; ++f) advance(s + f * V, d + f * V, v1.data(), decay, k[f], q[f], o.data(), V);
        const float den = std::max(o[K], eps);
        for (int64_t c = 0; c < K; ++c) O[i * K + c] = o[c] / den;
      }
    }); };
    if (half) pass(old.data_ptr<at::Half>(), next.data_ptr<at::Half>());
    else pass(old.data_ptr<float>(), next.data_ptr<float>());
    return out(heads.view({R, C}));
  }
};

// Cross attention over a source: softmax over its cached keys and values (the whole source, or a sentence window's
// span), or RFA from its state.
struct Cross {
  enum Kind { kSoftmax = 0, kWindow = 1, kRFA = 2 } kind = kSoftmax;
  Linear q, out;
  Tensor projection;  // RFA: [H, K, D]
  int64_t H = 0;
  float scaling = 1.f, eps = 0.01f;

  // x [R, C]; cache: softmax: keys, values [S, H, T, K], the keys' padding mask [S, T] (or undefined); window:
  // keys | values [S, H, T, 2 K], spans [S, J, 2], with the rows' sentence numbers; RFA: the state [S, H, F, K + 1];
  // source [R]: each row's source.
  Tensor operator()(const Tensor& x, const std::vector<Tensor>& cache, const Tensor& sentence,
                    const std::vector<int64_t>& source) const {
    const int64_t R = x.size(0), C = x.size(1), K = C / H;
    Tensor queries = q(x);
    Tensor heads = at::empty({R, H, K}, x.options());
    float* O = heads.data_ptr<float>();
    if (kind == kRFA) {
      const Tensor& state = cache[0];  // [S, H, F, K + 1]
      const int64_t F = state.size(2), V = K + 1;
      Tensor phi = gaussian_features(queries.view({R, H, K}), projection);
      const float *PHI = phi.data_ptr<float>(), *ST = state.data_ptr<float>();
      at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> o(V);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t r = i / H, h = i % H;
          const float* s = ST + (source[r] * H + h) * F * V;
          std::fill(o.begin(), o.end(), 0.f);
          for (int64_t f = 0; f < F; ++f)
            for (int64_t c = 0; c < V; ++c) o[c] += PHI[i * F + f] * s[f * V + c];
          const float den = std::max(o[K], eps);
          for (int64_t c = 0; c < K; ++c) O[i * K + c] = o[c] / den;
        }
      });
      return out(heads.view({R, C}));
    }
    const bool window = kind == kWindow;
    const Tensor& keys = cache[0];
    const int64_t T = keys.size(2), stride = window ? 2 * K : K;  // a key's numbers; its value's follow (window)
    const float* KEYS = keys.data_ptr<float>();
    const float* VALUES = window ? KEYS + K : cache[1].data_ptr<float>();
    const bool* mask = !window && cache.size() > 2 && cache[2].defined() ? cache[2].data_ptr<bool>() : nullptr;
    const int64_t* spans = window ? cache[1].data_ptr<int64_t>() : nullptr;
    const int64_t J = window ? cache[1].size(1) : 0;
    const int64_t* number = window ? sentence.data_ptr<int64_t>() : nullptr;
    const float* Q = queries.data_ptr<float>();
    at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p(T);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / H, h = i % H, s = source[r];
        int64_t first = 0, last = T;
        if (window) {
          const int64_t* span = spans + (s * J + std::min(number[r], J - 1)) * 2;
          first = span[0], last = span[1];
        }
        const float* query = Q + r * C + h * K;
        const int64_t at = (s * H + h) * T;
        float top = -INFINITY;
        for (int64_t t = first; t < last; ++t) {
          if (mask && mask[s * T + t]) {
            p[t] = -INFINITY;
            continue;
          }
          p[t] = dot(query, KEYS + (at + t) * stride, K) * scaling;
          top = std::max(top, p[t]);
        }
        float total = 0.f;
        for (int64_t t = first; t < last; ++t) total += (p[t] = std::exp(p[t] - top));
        float* o = O + i * K;
        std::fill(o, o + K, 0.f);
        for (int64_t t = first; t < last; ++t) {
          const float* value = VALUES + (at + t) * stride;
          const float weight = p[t] / total;
          for (int64_t c = 0; c < K; ++c) o[c] += weight * value[c];
        }
      }
    });
    return out(heads.view({R, C}));
  }
};

// fairseq's residual block: post-norm norm(x + f(x)), pre-norm x + f(norm(x))
template <typename Fn>
Tensor block(const Tensor& x, const Norm& n, bool pre_norm, Fn&& f) {
  if (pre_norm) {
    Tensor h = x.clone();
    n(h);
    return f(h).add_(x);
  }
  Tensor y = f(x);
  n(y, &x);
  return y;
}

// fairseq's FFN: fc2(activation(fc1(h)))
Tensor ffn(const Linear& fc1, const Linear& fc2, bool gelu, const Tensor& h) {
  Tensor hidden = fc1(h);
  return fc2(gelu ? at::gelu(hidden) : hidden.clamp_min_(0.f));
}

struct Layer {
  CausalRFA self;
  Norm self_norm, cross_norm, ffn_norm;
  bool has_cross = false, pre_norm = false, gelu = false;
  Cross cross;
  Linear fc1, fc2;
};

// A hypothesis of the beam search in the making: its tokens, their running scores, and for sentence-aligned decoding
// the <sep> it wrote and its tokens since the last (or since the start).
struct Row {
  std::vector<int64_t> tokens;
  std::vector<float> scores;
  int64_t written = 0, since = 0;
};

// Sentence-aligned decoding's bounds (rfa_decoder.py): a sentence ends from a x its source sentence's tokens + b, not
// before min x them; the log-probability of a forbidden </s>.
struct Bounds {
  float min = 0.f, a = 0.f, b = 0.f, forbidden_eos = 0.f;
};

// The whole decoder (RFATransformerDecoder.forward_step), built once from the modules' weights.
class Decoder {
 public:
  Decoder(const Weights& w, const Numbers& n, const std::vector<Weights>& layer_weights,
          const std::vector<Numbers>& layer_numbers, int64_t int8_min_weights)
      : embed_(weight(w, "embed_tokens.weight")), embed_scale_(number(n, "embed_scale")),
        padding_idx_(static_cast<int64_t>(number(n, "padding_idx"))) {
    output_ = linear(w, "output_projection", int8_min_weights);
    if (w.count("project_in_dim.weight")) project_in_ = linear(w, "project_in_dim", int8_min_weights);
    if (w.count("project_out_dim.weight")) project_out_ = linear(w, "project_out_dim", int8_min_weights);
    if (w.count("sentence_table")) sentence_table_ = weight(w, "sentence_table");
    if (w.count("layernorm_embedding.weight")) embed_norm_ = norm(w, n, "layernorm_embedding"), has_embed_norm_ = true;
    if (w.count("layer_norm.weight")) final_norm_ = norm(w, n, "layer_norm"), has_final_norm_ = true;
    for (size_t i = 0; i < layer_weights.size(); ++i) {
      const Weights& lw = layer_weights[i];
      const Numbers& ln = layer_numbers[i];
      Layer layer;
      layer.pre_norm = number(ln, "normalize_before") != 0;
      layer.gelu = number(ln, "gelu") != 0;
      layer.self.in = linear(lw, "self_attn.in_proj", int8_min_weights);
      layer.self.out = linear(lw, "self_attn.out_proj", int8_min_weights);
      layer.self.projection = weight(lw, "self_attn.projection");
      layer.self.H = layer.self.projection.size(0);
      layer.self.gated = number(ln, "self_attn.gated") != 0;
      layer.self.convex = number(ln, "self_attn.convex") != 0;
      layer.self.eps = static_cast<float>(number(ln, "self_attn.eps"));
      layer.self_norm = norm(lw, ln, "self_attn_layer_norm");
      layer.has_cross = ln.count("encoder_attn.kind") > 0;
      if (layer.has_cross) {
        Cross& c = layer.cross;
        c.kind = static_cast<Cross::Kind>(number(ln, "encoder_attn.kind"));
        c.q = linear(lw, "encoder_attn.q_proj", int8_min_weights);
        c.out = linear(lw, "encoder_attn.out_proj", int8_min_weights);
        c.H = static_cast<int64_t>(number(ln, "encoder_attn.heads"));
        c.scaling = static_cast<float>(number(ln, "encoder_attn.scaling"));
        c.eps = static_cast<float>(number(ln, "encoder_attn.eps"));
        c.projection = optional_weight(lw, "encoder_attn.projection");
        layer.cross_norm = norm(lw, ln, "encoder_attn_layer_norm");
      }
      layer.fc1 = linear(lw, "fc1", int8_min_weights);
      layer.fc2 = linear(lw, "fc2", int8_min_weights);
      layer.ffn_norm = norm(lw, ln, "final_layer_norm");
      layers_.push_back(std::move(layer));
    }
  }

  // tokens [R] at position (the position table's row, with the table: none without positional embeddings), the
  // rows' sentence numbers [R] (--sentence-index: added to the positions as models/sentence_index.py's sinusoids;
  // --cross-sentence-window: the window), parents [R]; per layer its causal state (the previous step's rows), the
  // buffer for the advanced state [R, ...] and its cross attention's cache (the beams of a source side by side): the
  // scores [R, V].
  Tensor step(const Tensor& tokens, int64_t position, const c10::optional<Tensor>& table,
              const c10::optional<Tensor>& sentence, const Tensor& parents, const std::vector<Tensor>& states,
              std::vector<Tensor> next, const std::vector<std::vector<Tensor>>& caches) {
    const int64_t R = tokens.size(0);
    std::vector<int64_t> source(R);
    for (size_t i = 0; i < caches.size(); ++i) {
      if (caches[i].empty()) continue;
      const int64_t S = caches[i][0].size(0);
      TORCH_CHECK(R % S == 0, "compiled step: ", R, " rows are not the beams of ", S, " sources");
      for (int64_t r = 0; r < R; ++r) source[r] = r / (R / S);
    }
    return run(tokens, position, table, sentence.has_value() ? sentence->contiguous() : Tensor(), parents, states,
               next, caches, source);
  }

  // fairseq's beam search (SequenceGenerator with search.BeamSearch, its hypotheses) over this decoder's steps,
  // one call for a batch of S sources: per layer the causal state the first step reads (one row for every
  // hypothesis, a row per source or per hypothesis) and its cross attention's cache (a row per source or per
  // hypothesis); the scores' bias [V] (pad, --unkpen); search: beam, max_len, min_len, eos, the sentence separator
  // (-1: none) and with sentence-aligned decoding (per hypothesis its source's sentence lengths [S x beam, J] and last
  // sentence number [S x beam]: RFATransformerDecoder.align_sentences) its bounds. Per source its hypotheses: the
  // tokens (</s> last), each token's score and their sum (before --lenpen's normalisation).
  std::vector<std::vector<std::tuple<Tensor, Tensor, Tensor>>> generate(
      const std::vector<Tensor>& initial, const std::vector<std::vector<Tensor>>& caches,
      const c10::optional<Tensor>& table, const Tensor& bias_, const Numbers& search,
      const c10::optional<Tensor>& lengths_, const c10::optional<Tensor>& last_) {
    const int64_t beam = number(search, "beam"), max_len = number(search, "max_len");
    const int64_t min_len = number(search, "min_len"), eos = number(search, "eos");
    const int64_t separator = number(search, "separator"), S = number(search, "sources");
    const float temperature = number(search, "temperature");
    const Tensor bias = bias_.contiguous(), lengths = lengths_.has_value() ? lengths_->contiguous() : Tensor();
    const Tensor last = last_.has_value() ? last_->contiguous() : Tensor();
    const float* B = bias.data_ptr<float>();
    const int64_t V = bias.size(0), J = lengths.defined() ? lengths.size(1) : 0;  // lengths: each source's beams
    TORCH_CHECK(!lengths.defined() || lengths.size(0) == S * beam,
                "compiled search: sentence lengths of another batch");
    const Bounds bounds = lengths.defined() ? Bounds{static_cast<float>(number(search, "sentence_min")),
        static_cast<float>(number(search, "length_a")), static_cast<float>(number(search, "length_b")),
        static_cast<float>(number(search, "forbidden_eos"))} : Bounds{};
    TORCH_CHECK(initial.size() == layers_.size() && caches.size() == layers_.size() && V > 2 * beam,
                "compiled search: one state and cache per layer, more words than 2 x beam");
    int64_t copies = 1;  // a cache's rows a source (its beams', or one)
    for (const auto& cache : caches)
      if (!cache.empty()) copies = cache[0].size(0) / S;
    for (const auto& cache : caches)
      TORCH_CHECK(cache.empty() || cache[0].size(0) == S * copies, "compiled search: caches of another batch");
    std::vector<Row> rows(S * beam);
    std::vector<int64_t> active(S);  // the sources still searched, in order
    std::iota(active.begin(), active.end(), 0);
    std::vector<std::vector<char>> ignore(S, std::vector<char>(beam, 0));  // fairseq's cands_to_ignore
    std::vector<std::vector<std::tuple<Tensor, Tensor, Tensor>>> found(S);
    std::vector<Tensor> states(initial), buffers[2];
    for (size_t i = 0; i < initial.size(); ++i)
      for (int copy = 0; copy < 2; ++copy) buffers[copy].push_back(scratch(2 * i + copy, initial[i], S * beam));
    Tensor scores = scratch(2 * initial.size(), bias.unsqueeze(0), S * beam);  // each step's log-probabilities
    // the first step reads each source's starting state (one row, or its beams')
    Tensor parents = at::arange(S * beam, bias.options().dtype(torch::kLong));
    parents.div_(S * beam / initial[0].size(0), "trunc");
    for (int64_t step = 0; step <= max_len && !active.empty(); ++step) {
      const int64_t R = active.size() * beam;
      Tensor tokens = at::empty({R}, parents.options()), sentence = at::empty({R}, parents.options());
      std::vector<int64_t> source(R);
      for (int64_t r = 0; r < R; ++r) {
        tokens.data_ptr<int64_t>()[r] = step == 0 ? eos : rows[r].tokens.back();
        sentence.data_ptr<int64_t>()[r] = rows[r].written;
        source[r] = active[r / beam] * copies;
      }
      if (separator < 0) sentence = Tensor();
      std::vector<Tensor> next;
      for (auto& b : buffers[step % 2]) next.push_back(b.narrow(0, 0, R));
      Tensor logits = run(tokens, padding_idx_ + step + 1, table, sentence, parents, states, next, caches, source);
      states = next;
      if (temperature != 1.f) logits.div_(temperature);
      Tensor lprobs = scores.narrow(0, 0, R);
      at::log_softmax_out(lprobs, logits, 1);
      float* L = lprobs.data_ptr<float>();
      for (int64_t r = 0; r < R; ++r) {
        float* l = L + r * V;
        if (lengths.defined())
          align(l, V, rows[r], lengths.data_ptr<float>() + source[r] / copies * beam * J,
                last.data_ptr<int64_t>()[source[r] / copies * beam], separator, eos, bounds);
        if (step >= max_len)
          for (int64_t v = 0; v < V; ++v) l[v] = v == eos ? l[v] : -INFINITY;
        else if (step < min_len)
          l[eos] = -INFINITY;
      }
      // per source its 2 x beam best candidates (beam x V scores, the first beam's alone at the first step), each
      // a word's log-probability (NaN as -inf) plus fairseq's bias, plus its hypothesis's score
      const int64_t width = step == 0 ? V : beam * V, k = std::min(2 * beam, width - 1);
      std::vector<int64_t> kept, parent;
      std::vector<Row> grown;
      for (size_t i = 0; i < active.size(); ++i) {
        std::vector<std::pair<float, int64_t>> top;  // (score, beam x V + word), best first, ties by index
        bool full = false;
        float bound = -INFINITY;  // once full, the k-th score: a candidate must beat it
        for (int64_t b = 0; b < width / V; ++b) {
          float* __restrict__ l = L + (i * beam + b) * V;
          const float running = step == 0 ? 0.f : rows[i * beam + b].scores.back();
          for (int64_t v = 0; v < V; ++v) l[v] = ((std::isnan(l[v]) ? -INFINITY : l[v]) + B[v]) + running;
          for (int64_t v = 0; v < V; ++v) {  // the scores in place (a loop the compiler vectorizes), then the scan
            const float score = l[v];
            if (full && !(score > bound)) continue;
            auto at = std::upper_bound(top.begin(), top.end(), score,
                                       [](float s, const std::pair<float, int64_t>& t) { return s > t.first; });
            top.insert(at, {score, b * V + v});
            if (static_cast<int64_t>(top.size()) > k) top.pop_back();
            full = static_cast<int64_t>(top.size()) == k, bound = top.back().first;
          }
        }
        std::vector<char> ends(k);
        for (int64_t j = 0; j < k; ++j) ends[j] = top[j].second % V == eos && top[j].first != -INFINITY;
        bool seen = false;
        for (int64_t j = 0; j < beam; ++j) {  // fairseq's finalize_hypos: ends among the first beam finish
          if (!ends[j] || ignore[i][j]) continue;
          seen = true;
          if (static_cast<int64_t>(found[active[i]].size()) == beam) continue;
          const Row& row = rows[i * beam + top[j].second / V];
          Tensor t = at::empty({step + 1}, parents.options()), p = at::empty({step + 1}, bias.options());
          for (int64_t s = 0; s <= step; ++s) {
            const float total = s < step ? row.scores[s] : top[j].first;
            t.data_ptr<int64_t>()[s] = s < step ? row.tokens[s] : eos;
            p.data_ptr<float>()[s] = s == 0 ? total : total - row.scores[s - 1];
          }
          found[active[i]].emplace_back(t, p, at::full({}, top[j].first, bias.options()));
        }
        if (seen && (static_cast<int64_t>(found[active[i]].size()) == beam || step == max_len)) continue;
        TORCH_CHECK(step < max_len, "compiled search: a source unfinished at max_len");
        // the first beam candidates that do not end go on (then those that do, as ignored)
        std::vector<int64_t> order(k);
        for (int64_t j = 0; j < k; ++j) order[j] = (ends[j] || (j < beam && ignore[i][j])) * 2 * beam + j;
        std::sort(order.begin(), order.end());
        for (int64_t b = 0; b < beam; ++b) {
          const auto& [score, c] = top[order[b] % (2 * beam)];
          const Row& from = rows[i * beam + c / V];
          Row row = from;
          row.tokens.push_back(c % V);
          row.scores.push_back(score);
          const bool sep = c % V == separator;
          row.written += sep, row.since = sep ? 0 : from.since + 1;
          grown.push_back(std::move(row));
          parent.push_back(i * beam + c / V);
          ignore[i][b] = order[b] >= 2 * beam;
        }
        kept.push_back(i);
      }
      std::vector<int64_t> still;
      std::vector<std::vector<char>> still_ignore;
      for (int64_t i : kept) still.push_back(active[i]), still_ignore.push_back(ignore[i]);
      active.swap(still), ignore.swap(still_ignore), rows.swap(grown);
      parents = at::tensor(parent, parents.options());
    }
    return found;
  }

  // the output projection as a step runs it (tests, benchmarks)
  Tensor output(const Tensor& x) const { return output_(x.contiguous()); }

 private:
  // Buffer i for `rows` rows of `like`'s other sizes and type, kept between searches (at a batch's size, the causal
  // states are tens of MB: allocated anew, every search would fault in their pages again).
  Tensor scratch(size_t i, const Tensor& like, int64_t rows) {
    if (scratch_.size() <= i) scratch_.resize(i + 1);
    Tensor& b = scratch_[i];
    if (!b.defined() || b.size(0) < rows || b.sizes().slice(1) != like.sizes().slice(1) ||
        b.scalar_type() != like.scalar_type()) {
      std::vector<int64_t> shape = like.sizes().vec();
      shape[0] = rows;
      b = at::empty(shape, like.options());
    }
    return b.narrow(0, 0, rows);
  }

  // RFATransformerDecoder.align_sentences then get_normalized_probs on a row's log-probabilities l [V] (lengths [J]:
  // its source's sentences' tokens; last: the source's last sentence number)
  static void align(float* l, int64_t V, const Row& row, const float* lengths, int64_t last, int64_t separator,
                    int64_t eos, const Bounds& bounds) {
    const float n = lengths[std::min(row.written, last)], since = static_cast<float>(row.since);
    const bool more = row.written < last, short_ = since < n * bounds.min, end = since >= n * bounds.a + bounds.b;
    const bool forbid_eos = more || short_, forbid_sep = !more || short_;
    if (end) {  // every token at -inf but the ending
      const int64_t ending = forbid_eos ? separator : eos;
      const float keep = l[ending];
      std::fill(l, l + V, -INFINITY);
      l[ending] = keep;
    }
    if (forbid_eos) l[eos] = bounds.forbidden_eos;
    if (forbid_sep) l[separator] = -INFINITY;
  }

  Tensor run(const Tensor& tokens, int64_t position, const c10::optional<Tensor>& table, const Tensor& sentence,
             const Tensor& parents, const std::vector<Tensor>& states, std::vector<Tensor>& next,
             const std::vector<std::vector<Tensor>>& caches, const std::vector<int64_t>& source) {
    TORCH_CHECK(states.size() == layers_.size() && next.size() == layers_.size() && caches.size() == layers_.size(),
                "compiled step: one state, buffer and cache per layer");
    const int64_t R = tokens.size(0), C = embed_.size(1);
    Tensor x = at::empty({R, C}, embed_.options());  // the tokens' embeddings, scaled
    const auto ids = tokens.accessor<int64_t, 1>();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t token = ids[r];
      TORCH_CHECK(token >= 0 && token < embed_.size(0), "compiled step: token ", token, " out of the vocabulary");
      const float* e = embed_.data_ptr<float>() + token * C;
      float* row = x.data_ptr<float>() + r * C;
      for (int64_t c = 0; c < C; ++c) row[c] = e[c] * static_cast<float>(embed_scale_);
    }
    if (project_in_.defined()) x = project_in_(x);
    if (table.has_value()) {
      TORCH_CHECK(position < table->size(0), "compiled step: position ", position, " past the position table");
      x.add_(table->select(0, position));
      if (sentence.defined() && sentence_table_.defined()) x.add_(sentence_table_.index_select(0, sentence));
    }
    if (has_embed_norm_) embed_norm_(x);
    Tensor pad = tokens.eq(padding_idx_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      x = block(x, layer.self_norm, layer.pre_norm,
                [&](const Tensor& h) { return layer.self(h, pad, states[i], next[i], parents); });
      if (layer.has_cross)
        x = block(x, layer.cross_norm, layer.pre_norm,
                  [&](const Tensor& h) { return layer.cross(h, caches[i], sentence, source); });
      x = block(x, layer.ffn_norm, layer.pre_norm,
                [&](const Tensor& h) { return ffn(layer.fc1, layer.fc2, layer.gelu, h); });
    }
    if (has_final_norm_) final_norm_(x);
    if (project_out_.defined()) x = project_out_(x);
    return output_(x);
  }

  Tensor embed_, sentence_table_;  // sentence_table_ (--sentence-index): sentence_index.sentence_embedding by number
  double embed_scale_;
  int64_t padding_idx_;
  Linear output_, project_in_, project_out_;  // the projections: where the embeddings' size differs
  Norm embed_norm_, final_norm_;
  bool has_embed_norm_ = false, has_final_norm_ = false;
  std::vector<Layer> layers_;
  std::vector<Tensor> scratch_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<const Weights&, const Numbers&, const std::vector<Weights>&, const std::vector<Numbers>&,
                          int64_t>())
      .def("step", &Decoder::step, "one decoding step (see the C++ source)")
      .def("generate", &Decoder::generate, "the beam search over the steps (see the C++ source)")
      .def("output", &Decoder::output);
  m.def("reduce_range", &reduce_range, "whether int8 products quantize their inputs to 7 bits (no VNNI)");
  m.attr("OWN_MACS") = OWN_MACS;
}
