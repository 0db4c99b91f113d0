// Mamba2 SSD's recurrence on CPU (kernels/ssd/cpu.py): a varlen batch over a state pool, in
// place.
//
// Per head h (group g = h / (H / G)), state S [P, N] and one token, with the step
// dt' = clamp(softplus(dt + dt_bias), lo, hi) (kernels/ssd/reference.py discretize_dt: the
// softplus only when asked, torch's threshold of 20) and decay = exp(dt' A[h]) taken here,
// one scalar formula for every caller:
//     S = decay * S + (dt' x) B^T;   y = S C          (the D skip is the caller's)
// A head's state (32 KiB at 64 x 128) stays in L1 across every token of its sequence: read
// from the pool once and written once per call. Every token runs the recurrence (no chunked
// form), so a token gets the same bits in any kind of batch (decode, verify, prefill, mixed;
// y[p] is one multiply-add chain per lane over N, then a fixed tree), not the torch
// reference's (MKL's products, a chunked form for long segments): tests hold them close.
#include "native_common.h"

namespace {

struct SsdRows {
  const float* x;          // [T, H, P]
  const float* dt;         // [T, H]: raw
  const float* dt_bias;    // [H]
  const float* A;          // [H]
  const float* B;          // [T, G, N]
  const float* C;
  float* y;                // [T, H, P]
  int64_t H, G, P, N;
  bool softplus;
  float lo, hi;            // dt' limits

  float step(int64_t r, int64_t h) const {
    float v = dt[r * H + h] + dt_bias[h];
    if (softplus) v = v > 20.0f ? v : std::log1p(std::exp(v));
    return std::min(std::max(v, lo), hi);
  }
};

// Every token of rows row0 .. row0 + n - 1 on head h's fp32 state S [P, N]; snap[t] (or
// null): where the state after token t is also written (a pool of `dtype`).
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void ssd_head(float* S, const SsdRows& in, int64_t row0, int64_t n, int64_t h, char* const* snap,
              at::ScalarType dtype) {
  const int64_t P = in.P, N = in.N, n16 = N & ~int64_t(15), g = h / (in.H / in.G);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t r = row0 + t;
    const float step = in.step(r, h), d = std::exp(step * in.A[h]);
    const float* x = in.x + (r * in.H + h) * P;
    const float* b = in.B + (r * in.G + g) * N;
    const float* c = in.C + (r * in.G + g) * N;
    float* y = in.y + (r * in.H + h) * P;
    for (int64_t p = 0; p < P; ++p) {
      const float xdt = x[p] * step;
      float* row = S + p * N;
      v16 acc = v16{};
      for (int64_t j = 0; j < n16; j += 16) {
        const v16 s = d * load16(row + j) + xdt * load16(b + j);
        store16(row + j, s);
        acc += s * load16(c + j);
      }
      float tail = 0.0f;
      for (int64_t j = n16; j < N; ++j) {          // the same chain, one lane at a time
        row[j] = d * row[j] + xdt * b[j];
        tail += row[j] * c[j];
      }
      y[p] = hsum(acc) + tail;
    }
    if (snap != nullptr && snap[t] != nullptr) {
      for (int64_t e = 0; e < P * N; ++e) store_state(snap[t], dtype, e, S[e]);
    }
  }
}

StatePool ssd_pool(at::Tensor& states) {
  TORCH_CHECK(is_state_dtype(states.scalar_type()) && states.dim() == 4 && states.device().is_cpu() &&
                  states.size(1) > 0 && states.size(2) > 0 && states.size(3) > 0 && states.stride(3) == 1 &&
                  states.stride(2) == states.size(3) && states.stride(1) == states.size(2) * states.size(3),
              "ssd_recurrent: states must be a CPU [S, H, P, N] pool of fp32 / bf16 / fp16 with contiguous "
              "slots, got ", states.sizes(), " ", states.scalar_type());
  return state_pool("ssd_recurrent", states);
}

void check_ssd_inputs(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& dt_bias, const at::Tensor& A,
                      const at::Tensor& B, const at::Tensor& C, int64_t H, int64_t P, int64_t N) {
  for (const at::Tensor* t : {&x, &dt, &dt_bias, &A, &B, &C}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "ssd_recurrent: inputs must be contiguous fp32 CPU tensors");
  }
  const int64_t rows = x.numel() / (H * P);
  TORCH_CHECK(x.numel() == rows * H * P && dt.numel() == rows * H && A.numel() == H && dt_bias.numel() == H &&
                  B.sizes() == C.sizes() &&
                  B.dim() == 3 && B.size(0) == rows && B.size(2) == N && B.size(1) > 0 && H % B.size(1) == 0,
              "ssd_recurrent: x ", x.sizes(), ", dt ", dt.sizes(), ", A ", A.sizes(), ", B ", B.sizes(), ", C ",
              C.sizes(), " do not fit H=", H, " P=", P, " N=", N);
}

}  // namespace

// kernels/ssd/cpu.py: cu_seqlens / slots / has_initial_state / dst as kernels/__init__.py's
// conventions (None: every initial state present; no snapshots); x [T, H, P], dt [T, H]
// (raw), dt_bias / A [H], B / C [T, G, N], the dt rule (softplus, limits) -> y [T, H, P]
// without the D skip.
at::Tensor ssd_recurrent(at::Tensor states, const at::Tensor& cu_seqlens, const at::Tensor& slots,
                         const std::optional<at::Tensor>& has_initial_state, const std::optional<at::Tensor>& dst,
                         const at::Tensor& x, const at::Tensor& dt, const at::Tensor& dt_bias, const at::Tensor& A,
                         const at::Tensor& B, const at::Tensor& C, bool softplus, double dt_min, double dt_max) {
  const StatePool pool = ssd_pool(states);
  const int64_t H = states.size(1), P = states.size(2), N = states.size(3);
  const int64_t rows = x.numel() / (H * P);
  const VarlenBatch batch = varlen_batch("ssd_recurrent", cu_seqlens, slots, has_initial_state, dst, rows);
  check_ssd_inputs(x, dt, dt_bias, A, B, C, H, P, N);
  at::Tensor y = at::empty({rows, H, P}, x.options());
  const SsdRows in{x.data_ptr<float>(), dt.data_ptr<float>(), dt_bias.data_ptr<float>(), A.data_ptr<float>(),
                   B.data_ptr<float>(), C.data_ptr<float>(), y.data_ptr<float>(), H, rows > 0 ? B.size(1) : 1,
                   P, N, softplus, static_cast<float>(dt_min), static_cast<float>(dt_max)};
  const int64_t head_bytes = P * N * states.element_size();
  for_each_head(batch, pool, H, head_bytes,
                [&](char* state, char* const* snaps, int64_t row0, int64_t n, int64_t h, bool initial) {
                  on_fp32_state(state, pool.dtype, initial, P * N,
                                [&](float* S) { ssd_head(S, in, row0, n, h, snaps, pool.dtype); });
                });
  return y;
}

TORCH_LIBRARY_FRAGMENT(hybridserve_native, m) {
  m.def("ssd_recurrent(Tensor(a!) states, Tensor cu_seqlens, Tensor slots, Tensor? has_initial_state, "
        "Tensor? dst, Tensor x, Tensor dt, Tensor dt_bias, Tensor A, Tensor B, Tensor C, bool softplus, "
        "float dt_min, float dt_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("ssd_recurrent", &ssd_recurrent);
}
