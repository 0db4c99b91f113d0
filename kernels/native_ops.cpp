// The native ops of kernels/native_ops.py (which builds every native_*.cpp into one library
// and defines the HS_* constants from kernels/cpu_linear.py). This file defines the library.
#include "native_common.h"

#ifndef HS_PREFERS_ONEDNN
#error "kernels/native_ops.py defines HS_PREFERS_ONEDNN, HS_MIN_ROWS and HS_MIN_MACS"
#endif

// dst[index] = src along dim 0, in place (the rows of a state pool).
void scatter_rows(at::Tensor dst, const at::Tensor& index, const at::Tensor& src) {
  dst.index_copy_(0, index, src);
}

// The activations of workers/models/layers.py ACTIVATIONS, by HF name.
at::Tensor activate(const at::Tensor& x, const std::string& act) {
  if (act == "silu" || act == "swish") return at::silu(x);
  if (act == "gelu") return at::gelu(x);
  if (act == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  if (act == "relu") return at::relu(x);
  if (act == "relu2") return at::square(at::relu(x));
  TORCH_CHECK(false, "moe_experts: activation ", act, " is not supported");
}

// workers/models/moe_experts.py swiglu: act(gate) * up, clipped where limit > 0 (Ling's
// min(act(gate), limit) * clamp(up, -limit, limit)).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, const std::string& act, double limit) {
  if (limit <= 0) return activate(gate, act) * up;
  return activate(gate, act).clamp_max(limit) * up.clamp(-limit, limit);
}

// kernels/cpu_linear.py linear (no bias, no autograd, never traced here): oneDNN from
// MIN_ROWS rows and MIN_MACS multiply-adds in fp32 where the build has it and the machine
// prefers it (cpu_linear.prefers_onednn), else at::linear.
at::Tensor dense(const at::Tensor& x, const at::Tensor& w) {
  static const std::optional<c10::OperatorHandle> onednn =
      at::hasMKLDNN() ? c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""})
                      : std::nullopt;
  const int64_t rows = x.size(-1) > 0 ? x.numel() / x.size(-1) : 0;
  if (HS_PREFERS_ONEDNN && onednn.has_value() && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
      w.is_contiguous() && w.dim() == 2 && rows >= HS_MIN_ROWS &&
      rows * w.size(1) * w.size(0) >= HS_MIN_MACS) {
    torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::string("")};
    onednn->callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w);
}

// ---- The few-rows expert MLP: fp32, at most SMALL_ROWS rows an expert (a decode step's) ----
//
// A decode step reads every chosen expert's weights once for a handful of rows, so its time
// is the weights' bytes, which the loop's three ATen GEMMs an expert (MKL's small-M sgemm) and
// its ATen glue read at well under a plain read's bandwidth. Here the GEMMs are
// native_gemm.cpp's few_rows_gemm (each weight row read once against all the expert's rows)
// and the glue is plain loops over host memory. Its sums are not MKL's: callers take
// this path by shape alone (few_rows), so equal shapes give equal bits everywhere, and a
// row's bits do not depend on the other rows.
namespace {

constexpr int64_t ROW_ALIGN = 64;

// Whether expert e's n rows take the few-rows path: a shape rule, the same for every caller.
bool few_rows(int64_t n, const at::Tensor& x, const std::optional<at::Tensor>& w_gate,
              const at::Tensor& w_up, const at::Tensor& w_down) {
  return n <= SMALL_ROWS && x.scalar_type() == at::kFloat && w_up.scalar_type() == at::kFloat &&
         w_down.scalar_type() == at::kFloat && rows_contiguous(w_up) && rows_contiguous(w_down) &&
         (!w_gate.has_value() || (w_gate->scalar_type() == at::kFloat && rows_contiguous(*w_gate)));
}

// out[token(r)] += weight(r) * y[j] for the n (token, choice) rows of an expert: y [n, HO].
void add_weighted(const int64_t* rows, int64_t n, int64_t k, const float* flat_weights, const float* y,
                  int64_t HO, at::Tensor& out) {
  float* op = out.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) {
    float* o = op + (rows[j] / k) * HO;
    const float wr = flat_weights[rows[j]];
    const float* yj = y + j * HO;
    for (int64_t c = 0; c < HO; ++c) o[c] += yj[c] * wr;
  }
}

// A gated SiLU expert (silu(gate(x)) * up(x), then down) on its few rows h[0..n), without
// ATen between the GEMMs: at 4 rows an expert of 256 x 256 spent as long in the glue's ATen
// calls (zeros, silu, mul_, empty) as in its weights. Rows ld floats apart, zero-padded.
void expert_few_rows_silu(const float* const* h, const int64_t* rows, int64_t n, int64_t k,
                          const float* flat_weights, const at::Tensor& gate_w, const at::Tensor& up_w,
                          const at::Tensor& down_w, int64_t ld, at::Tensor& out) {
  const int64_t H = up_w.size(1), I = up_w.size(0), HO = down_w.size(0);
  std::vector<float> buf(2 * n * ld + n * HO);           // up, gate (then the inner rows), y
  float *up = buf.data(), *gate = up + n * ld, *y = gate + n * ld;
  few_rows_gemm(h, n, up_w.data_ptr<float>(), up_w.stride(0), I, H, up, ld);
  few_rows_gemm(h, n, gate_w.data_ptr<float>(), gate_w.stride(0), I, H, gate, ld);
  for (int64_t i = 0; i < n * ld; i += 16) store16(gate + i, silu_of<v16, v16i>(load16(gate + i)) * load16(up + i));
  const float* in_rows[SMALL_ROWS];
  for (int64_t j = 0; j < n; ++j) in_rows[j] = gate + j * ld;
  few_rows_gemm(in_rows, n, down_w.data_ptr<float>(), down_w.stride(0), HO, I, y, HO);
  add_weighted(rows, n, k, flat_weights, y, HO, out);
}

// out[token(r)] += weight(r) * expert(x[token(r)]) for the n (token, choice) rows `rows` of
// expert e; x is contiguous fp32 [T, H], out is [T, H].
void expert_few_rows(const at::Tensor& x, const int64_t* rows, int64_t n, int64_t k,
                     const float* flat_weights, const std::optional<at::Tensor>& w_gate,
                     const at::Tensor& w_up, const at::Tensor& w_down, int64_t e,
                     const std::string& act, double limit, at::Tensor& out) {
  const int64_t H = x.size(1), I = w_up.size(1), HO = w_down.size(1);
  const float* xp = x.data_ptr<float>();
  const float* h[SMALL_ROWS];
  for (int64_t j = 0; j < n; ++j) h[j] = xp + (rows[j] / k) * H;
  const at::Tensor up_w = w_up.select(0, e), down_w = w_down.select(0, e);
  // Rows ROW_ALIGN floats apart, the padding zero: ATen's vectorised activations finish a
  // length that is not a multiple of their vector pair with the scalar formula (other bits),
  // so at a padded width every element takes the vector formula whatever n is.
  const int64_t ld = (I + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
  if (w_gate.has_value() && (act == "silu" || act == "swish") && limit <= 0) {
    expert_few_rows_silu(h, rows, n, k, flat_weights, w_gate->select(0, e), up_w, down_w, ld, out);
    return;
  }
  at::Tensor up = at::zeros({n, ld}, x.options());
  few_rows_gemm(h, n, up_w.data_ptr<float>(), up_w.stride(0), I, H, up.data_ptr<float>(), ld);
  at::Tensor inner;
  if (w_gate.has_value()) {
    const at::Tensor gate_w = w_gate->select(0, e);
    at::Tensor gate = at::zeros({n, ld}, x.options());
    few_rows_gemm(h, n, gate_w.data_ptr<float>(), gate_w.stride(0), I, H, gate.data_ptr<float>(), ld);
    inner = swiglu(gate, up, act, limit);
  } else {
    inner = activate(up, act);
  }
  TORCH_CHECK(inner.is_contiguous());
  const float* ip = inner.data_ptr<float>();
  const float* in_rows[SMALL_ROWS];
  for (int64_t j = 0; j < n; ++j) in_rows[j] = ip + j * ld;
  at::Tensor y = at::empty({n, HO}, x.options());
  float* yp = y.data_ptr<float>();
  few_rows_gemm(in_rows, n, down_w.data_ptr<float>(), down_w.stride(0), HO, I, yp, HO);
  add_weighted(rows, n, k, flat_weights, yp, HO, out);
}

// A gated SiLU expert on many fp32 rows: the loop's three ATen GEMMs (dense, as the Python
// loop) with the glue in one pass each -- the rows gathered, silu(gate) * up, the weighted
// add into out -- where ATen's glue made ~8 passes over [n, I] / [n, H] (index, silu, mul,
// index, mul, add_, index_put): a prefill's experts spent about as long in that glue as in
// their GEMMs.
bool many_rows_silu(const at::Tensor& x, const std::optional<at::Tensor>& w_gate, const std::string& act,
                    double limit) {
  return x.scalar_type() == at::kFloat && w_gate.has_value() && w_gate->scalar_type() == at::kFloat &&
         (act == "silu" || act == "swish") && limit <= 0;
}

void expert_many_rows_silu(const at::Tensor& x, const int64_t* rows, int64_t n, int64_t k,
                           const float* flat_weights, const at::Tensor& gate_w, const at::Tensor& up_w,
                           const at::Tensor& down_w, at::Tensor& out) {
  const int64_t H = x.size(1);
  at::Tensor h = at::empty({n, H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) std::memcpy(hp + j * H, xp + (rows[j] / k) * H, H * sizeof(float));
  at::Tensor gate = dense(h, gate_w).contiguous();
  const at::Tensor up = dense(h, up_w).contiguous();
  const int64_t I = gate.size(1);
  float* gp = gate.data_ptr<float>();
  silu_mul_rows(gp, I, up.data_ptr<float>(), I, n, I, gp);        // in place, each row its own bits
  const at::Tensor y = dense(gate, down_w).contiguous();
  add_weighted(rows, n, k, flat_weights, y.data_ptr<float>(), y.size(1), out);
}

}  // namespace

// workers/models/moe_experts.py expert_loop: the (token, choice) rows in expert order (a
// stable counting sort), each chosen expert's MLP on its rows, weighted and added per token,
// experts ascending. An expert with few rows takes expert_few_rows, the others the loop's
// ATen kernels (oneDNN or at::linear, as cpu_linear.linear), op for op as the Python loop.
// `invariant` (kernels/dense.py's batch-invariant mode) takes every expert's rows through
// expert_few_rows, SMALL_ROWS at a time, so a token's bits do not depend on how many other
// rows chose its experts.
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& weights, const at::Tensor& ids,
                       const std::optional<at::Tensor>& w_gate, const at::Tensor& w_up,
                       const at::Tensor& w_down, std::string act, double limit, bool invariant) {
  const int64_t k = ids.size(1), num_experts = w_up.size(0), num_rows = ids.numel();
  const at::Tensor x = x_in.contiguous();
  const at::Tensor flat_ids = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t* id = flat_ids.data_ptr<int64_t>();
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < num_experts, "moe_experts: expert id ", id[r], " of ", num_experts);
    ++start[id[r] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  at::Tensor order = at::empty({num_rows}, flat_ids.options());
  int64_t* ord = order.data_ptr<int64_t>();
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < num_rows; ++r) ord[next[id[r]]++] = r;
  const at::Tensor flat_weights = weights.reshape({-1}).contiguous();
  at::Tensor out = at::zeros({x.size(0), w_down.size(1)}, x.options());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const bool few = flat_weights.scalar_type() == at::kFloat &&
                     few_rows(invariant ? std::min(n, SMALL_ROWS) : n, x, w_gate, w_up, w_down);
    TORCH_CHECK(few || !invariant, "moe_experts: the batch-invariant mode needs fp32 experts with contiguous rows");
    for (int64_t j = 0; few && j < n; j += SMALL_ROWS)
      expert_few_rows(x, ord + start[e] + j, std::min(SMALL_ROWS, n - j), k, flat_weights.data_ptr<float>(),
                      w_gate, w_up, w_down, e, act, limit, out);
    if (few) continue;
    if (many_rows_silu(x, w_gate, act, limit) && flat_weights.scalar_type() == at::kFloat) {
      expert_many_rows_silu(x, ord + start[e], n, k, flat_weights.data_ptr<float>(), w_gate->select(0, e),
                            w_up.select(0, e), w_down.select(0, e), out);
      continue;
    }
    at::Tensor rows = order.slice(0, start[e], start[e] + n);
    at::Tensor tokens = at::div(rows, k, "floor");
    at::Tensor h = at::index(x, {tokens});
    at::Tensor up = dense(h, w_up.select(0, e));
    at::Tensor inner = w_gate.has_value()
        ? swiglu(dense(h, w_gate->select(0, e)), up, act, limit) : activate(up, act);
    at::Tensor y = dense(inner, w_down.select(0, e));
    at::Tensor acc = at::index(out, {tokens});
    acc.add_(y * at::index(flat_weights, {rows}).unsqueeze(1));
    out.index_put_({tokens}, acc);
  }
  return out;
}

TORCH_LIBRARY(hybridserve_native, m) {
  m.def("scatter_rows(Tensor(a!) dst, Tensor index, Tensor src) -> ()");
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor? w_gate, Tensor w_up, "
        "Tensor w_down, str act, float limit=0., bool invariant=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("scatter_rows", &scatter_rows);
  m.impl("moe_experts", &moe_experts);
}
