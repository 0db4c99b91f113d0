// Fused elementwise kernels of the eager CPU forward (kernels/fused_cpu.py): RMSNorm (plain,
// zero-centred, gated), SiLU(gate) * up, the GDN's scaled L2 norm of q / k and rotate-half
// RoPE. fp32 only; the
// Python side sends every other case to torch.
//
// Each replaces 4-8 ATen passes over the activations (pow, mean, add, rsqrt, mul, mul, silu,
// mul, each reading and writing the whole tensor) by one read and one write: at a prefill's
// 3,000 tokens the activations do not fit in L2, so the passes are memory-bound.
//
// Invariant (what keeps prefix caching and batching exact): a row's result depends on that
// row alone. Its sums run over its own D values, 16 lanes then a fixed tree then the tail in
// order, whatever the number of rows or where the row sits, so a token gets the same bits
// in any batch. Not the torch reference's bits (another order of the sum of squares).
#include "native_common.h"

namespace {

// sum of v[i]^2 for i < n: 16 lanes, the fixed tree, then the tail in order.
inline __attribute__((always_inline)) float sum_squares(const float* v, int64_t n) {
  const int64_t n16 = n & ~int64_t(15);
  v16 acc{};
  for (int64_t i = 0; i < n16; i += 16) {
    const v16 a = load16(v + i);
    acc += a * a;
  }
  float s = hsum(acc);
  for (int64_t i = n16; i < n; ++i) s += v[i] * v[i];
  return s;
}

// y[i] = (x[i] * s) * w[i], then * gate[i] when a gate is given, for i < n.
inline __attribute__((always_inline)) void scale_mul(const float* x, float s, const float* w, const float* gate,
                                                     float* y, int64_t n) {
  const int64_t n16 = n & ~int64_t(15);
  const v16 sv = v16{} + s;
  for (int64_t i = 0; i < n16; i += 16) {
    const v16 v = (load16(x + i) * sv) * load16(w + i);
    store16(y + i, gate == nullptr ? v : v * load16(gate + i));
  }
  for (int64_t i = n16; i < n; ++i) y[i] = gate == nullptr ? (x[i] * s) * w[i] : ((x[i] * s) * w[i]) * gate[i];
}

inline __attribute__((always_inline)) float inv_rms(const float* v, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_squares(v, n) / float(n) + eps);
}

// x as rows of D floats: a view when its layout allows one (a column slice of a wider
// tensor keeps its row stride), else a contiguous copy.
at::Tensor as_rows(const at::Tensor& x, int64_t D) {
  at::Tensor rows = x.reshape({-1, D});
  return rows.stride(1) == 1 || rows.size(0) == 0 ? rows : rows.contiguous();
}

void check_fp32(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() >= 1 &&
                  weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              op, ": fp32 x [..., D] and a contiguous fp32 weight [D]; got ", x.sizes(), " ", x.scalar_type(),
              " and ", weight.sizes(), " ", weight.scalar_type());
}

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void rms_rows(const float* x, int64_t ldx, int64_t rows, const float* w, bool zero_centered, float eps,
              int64_t D, float* y) {
  std::vector<float> scale(w, w + D);
  if (zero_centered) for (auto& s : scale) s += 1.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    scale_mul(xr, inv_rms(xr, D, eps), scale.data(), nullptr, y + r * D, D);
  }
}

// y = x * rsqrt(mean(x^2) + eps) * w (zero_centered: * (1 + w)), per row of D.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered) {
  check_fp32("rms_norm", x, weight);
  const int64_t D = x.size(-1);
  const at::Tensor rows = as_rows(x, D);
  at::Tensor y = at::empty(x.sizes(), x.options());
  rms_rows(rows.data_ptr<float>(), rows.stride(0), rows.size(0), weight.data_ptr<float>(), zero_centered,
           float(eps), D, y.data_ptr<float>());
  return y;
}

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void gated_rows(const float* x, int64_t ldx, const float* z, int64_t ldz, int64_t rows, const float* w,
                float eps, int64_t D, int64_t G, bool norm_before_gate, float* y) {
  std::vector<float> gate(D), t(D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * D;
    silu_mul(z + r * ldz, nullptr, gate.data(), D);                     // gate = silu(z)
    if (norm_before_gate) {                                              // norm(x) * w * gate
      for (int64_t g0 = 0; g0 < D; g0 += G)
        scale_mul(xr + g0, inv_rms(xr + g0, G, eps), w + g0, gate.data() + g0, yr + g0, G);
      continue;
    }
    for (int64_t d = 0; d < D; ++d) t[d] = xr[d] * gate[d];              // norm(x * gate) * w
    for (int64_t g0 = 0; g0 < D; g0 += G)
      scale_mul(t.data() + g0, inv_rms(t.data() + g0, G, eps), w + g0, nullptr, yr + g0, G);
  }
}

// Qwen3-Next's GDN output norm (norm_before_gate) or Mamba2's, rms per group of G channels.
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps,
                          int64_t group_size, bool norm_before_gate) {
  check_fp32("gated_rms_norm", x, weight);
  const int64_t D = x.size(-1);
  TORCH_CHECK(z.sizes() == x.sizes() && z.scalar_type() == at::kFloat && group_size > 0 && D % group_size == 0,
              "gated_rms_norm: z ", z.sizes(), " must be x's shape ", x.sizes(), " (fp32), group_size ",
              group_size, " must divide ", D);
  const at::Tensor xr = as_rows(x, D), zr = as_rows(z, D);
  at::Tensor y = at::empty(x.sizes(), x.options());
  gated_rows(xr.data_ptr<float>(), xr.stride(0), zr.data_ptr<float>(), zr.stride(0), xr.size(0),
             weight.data_ptr<float>(), float(eps), D, group_size, norm_before_gate, y.data_ptr<float>());
  return y;
}

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void l2norm_rows(const float* x, int64_t ldx, int64_t rows, int64_t D, float eps, float scale, float* y) {
  const std::vector<float> scales(D, scale);        // scale_mul takes a per-channel weight
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    scale_mul(xr, 1.0f / std::sqrt(sum_squares(xr, D) + eps), scales.data(), nullptr, y + r * D, D);
  }
}

// x * rsqrt(sum(x^2) + eps) * scale per row of D, contiguous (the GDN's q / k normalisation).
at::Tensor l2norm_scale(const at::Tensor& x, double eps, double scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "l2norm_scale: fp32 x [..., D]; got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t D = x.size(-1);
  const at::Tensor rows = as_rows(x, D);
  at::Tensor y = at::empty(x.sizes(), x.options());
  l2norm_rows(rows.data_ptr<float>(), rows.stride(0), rows.size(0), D, float(eps), float(scale), y.data_ptr<float>());
  return y;
}

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void rope_rows(const float* x, int64_t ldx, int64_t rows, int64_t H, int64_t D, const float* cos, const float* sin,
               int64_t rot, float* y) {
  const int64_t half = rot / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    const float* c = cos + (r / H) * rot;
    const float* s = sin + (r / H) * rot;
    float* yr = y + r * D;
    for (int64_t i = 0; i < half; ++i) yr[i] = xr[i] * c[i] + (-xr[i + half]) * s[i];
    for (int64_t i = half; i < rot; ++i) yr[i] = xr[i] * c[i] + xr[i - half] * s[i];
    std::memcpy(yr + rot, xr + rot, (D - rot) * sizeof(float));
  }
}

// Rotate-half RoPE on the first `rot` dims of each head of x [T, H, D] by cos / sin [T, rot];
// the other dims pass through (layers.apply_rotary).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0,
              "rope: fp32 x [T, H, D] and cos / sin [T, rot], rot even and <= D; got ", x.sizes(), " ",
              x.scalar_type(), " and ", cos.sizes(), " / ", sin.sizes());
  const int64_t D = x.size(2);
  const at::Tensor rows = as_rows(x, D), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  rope_rows(rows.data_ptr<float>(), rows.stride(0), rows.size(0), x.size(1), D, c.data_ptr<float>(),
            s.data_ptr<float>(), c.size(1), y.data_ptr<float>());
  return y;
}

// silu(gate) * up, fp32 [..., D] each (the gated MLPs' inner activation).
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat &&
                  gate.dim() >= 1,
              "silu_and_mul: fp32 gate and up of one shape; got ", gate.sizes(), " ", gate.scalar_type(), " and ",
              up.sizes(), " ", up.scalar_type());
  const int64_t D = gate.size(-1);
  const at::Tensor g = as_rows(gate, D), u = as_rows(up, D);
  at::Tensor y = at::empty(gate.sizes(), gate.options());
  silu_mul_rows(g.data_ptr<float>(), g.stride(0), u.data_ptr<float>(), u.stride(0), g.size(0), D,
                y.data_ptr<float>());
  return y;
}

}  // namespace

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void silu_mul_rows(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t rows, int64_t D, float* y) {
  for (int64_t r = 0; r < rows; ++r) silu_mul(g + r * ldg, u + r * ldu, y + r * D, D);
}

TORCH_LIBRARY_FRAGMENT(hybridserve_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool zero_centered) -> Tensor");
  m.def("gated_rms_norm(Tensor x, Tensor z, Tensor weight, float eps, int group_size, "
        "bool norm_before_gate) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("l2norm_scale(Tensor x, float eps, float scale) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("l2norm_scale", &l2norm_scale);
  m.impl("rope", &rope);
}
