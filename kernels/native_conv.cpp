// Depthwise causal conv1d on CPU (kernels/conv1d/cpu.py): a varlen batch over a conv-state
// pool, in place.
//
// Sequence b is convolved over `its W-1 initial inputs ++ its rows`: out[t, d] =
// sum_w weight[d, w] * in[t - (W-1) + w, d] (+ bias[d]), oldest input first, then SiLU if
// asked (silu_of). The initial inputs come from states[slots[b]]
// ([D, W-1], oldest first; zeros without an initial state); afterwards that slot holds the
// last W-1 inputs, and a snapshot slot dst[r] the W-1 inputs ending at row r.
//
// One pass over the rows, vectorised across channels (the torch path makes ~12 passes: an
// extended copy of the inputs, W products and W-1 sums over all of them, a gather of the
// tokens' rows, the state windows). Each output element is the same chain of multiply-adds
// wherever its row sits, so a token gets the same bits in any kind of batch (decode, verify,
// prefill, one thread or several); not the torch reference's bits (no FMA there).
#include "native_common.h"

namespace {

constexpr int64_t CONV_MAX_WIDTH = 16;

// One sequence's inputs: row j (j >= -(W-1), relative to its first row) is x's row or, for
// j < 0, one of the W-1 initial inputs held in `hist` ([W-1, D], oldest first).
struct ConvSeq {
  const float* x;          // the sequence's first row
  const float* hist;
  int64_t D, hist_len;

  const float* row(int64_t j) const { return j >= 0 ? x + j * D : hist + (hist_len + j) * D; }
};

// out rows [t0, t1) of one sequence: wt is the weight transposed [W, D].
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void conv_rows(const ConvSeq& seq, const float* wt, int64_t W, const float* bias, bool silu, float* out,
               int64_t t0, int64_t t1) {
  const int64_t D = seq.D, d16 = D & ~int64_t(15);
  const float* in[CONV_MAX_WIDTH];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t w = 0; w < W; ++w) in[w] = seq.row(t - (W - 1) + w);
    float* o = out + t * D;
    for (int64_t d = 0; d < d16; d += 16) {
      v16 acc = load16(in[0] + d) * load16(wt + d);
      for (int64_t w = 1; w < W; ++w) acc += load16(in[w] + d) * load16(wt + w * D + d);
      if (bias != nullptr) acc += load16(bias + d);
      if (silu) acc = silu_of<v16, v16i>(acc);
      std::memcpy(o + d, &acc, sizeof acc);
    }
    for (int64_t d = d16; d < D; ++d) {     // the same chain, one lane at a time
      float acc = in[0][d] * wt[d];
      for (int64_t w = 1; w < W; ++w) acc += in[w][d] * wt[w * D + d];
      if (bias != nullptr) acc += bias[d];
      o[d] = silu ? silu_of<float, int32_t>(acc) : acc;
    }
  }
}

// The W-1 inputs ending at row t of `seq` into a [D, W-1] state of `dtype`.
void store_window(const ConvSeq& seq, int64_t t, char* state, at::ScalarType dtype) {
  const int64_t hist = seq.hist_len, D = seq.D;
  for (int64_t j = 0; j < hist; ++j) {
    const float* r = seq.row(t - (hist - 1) + j);
    for (int64_t d = 0; d < D; ++d) store_state(state, dtype, d * hist + j, r[d]);
  }
}

StatePool conv_pool(at::Tensor& states, int64_t D, int64_t W) {
  TORCH_CHECK(is_state_dtype(states.scalar_type()) && states.dim() == 3 && states.device().is_cpu() &&
                  states.size(1) == D && states.size(2) == W - 1 && states.stride(2) == 1 &&
                  states.stride(1) == W - 1,
              "causal_conv1d: conv states must be a CPU [S, ", D, ", ", W - 1, "] pool of fp32 / bf16 / fp16 ",
              "with contiguous slots, got ", states.sizes(), " ", states.scalar_type());
  return state_pool("causal_conv1d", states);
}

}  // namespace

// kernels/conv1d/cpu.py: x [T, D] fp32 contiguous, weight [D, W] (W >= 2), bias [D] or None,
// states [S, D, W-1]; cu_seqlens / slots / has_initial_state / dst as kernels/__init__.py's
// conventions (None: every initial state present; no snapshots). -> [T, D], through silu when
// `silu` (silu_of), else the sums as they are.
at::Tensor causal_conv1d(at::Tensor states, const at::Tensor& cu_seqlens, const at::Tensor& slots,
                         const std::optional<at::Tensor>& has_initial_state, const std::optional<at::Tensor>& dst,
                         const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         bool silu) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.device().is_cpu(),
              "causal_conv1d: x must be a contiguous fp32 CPU [T, D] tensor, got ", x.sizes());
  const int64_t rows = x.size(0), D = x.size(1), W = weight.size(-1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && W >= 2 && W <= CONV_MAX_WIDTH,
              "causal_conv1d: weight ", weight.sizes(), " must be [", D, ", W] with 2 <= W <= ", CONV_MAX_WIDTH);
  TORCH_CHECK(!bias.has_value() || bias->numel() == D, "causal_conv1d: bias of ", D, " channels expected");
  const StatePool pool = conv_pool(states, D, W);
  const VarlenBatch batch = varlen_batch("causal_conv1d", cu_seqlens, slots, has_initial_state, dst, rows);
  const at::Tensor wt = weight.to(at::kFloat).t().contiguous();                  // [W, D]
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({rows, D}, x.options());
  const int64_t hist_len = W - 1;
  std::vector<float> hist(hist_len * D);
  for (int64_t s = 0; s < batch.num_seqs(); ++s) {
    const int64_t row0 = batch.cu[s], n = batch.cu[s + 1] - batch.cu[s];
    if (n == 0) continue;                          // untouched, as the conventions say
    char* live = pool.slot(batch.slot[s]);
    for (int64_t j = 0; j < hist_len; ++j) {       // [D, W-1] -> [W-1, D]
      for (int64_t d = 0; d < D; ++d) hist[j * D + d] = batch.initial[s] ? load_state(live, pool.dtype, d * hist_len + j) : 0.0f;
    }
    const ConvSeq seq{x.data_ptr<float>() + row0 * D, hist.data(), D, hist_len};
    float* o = out.data_ptr<float>() + row0 * D;
    at::parallel_for(0, n, 64, [&](int64_t t0, int64_t t1) {
      conv_rows(seq, wt.data_ptr<float>(), W, b.defined() ? b.data_ptr<float>() : nullptr, silu, o, t0, t1);
    });
    for (int64_t t = 0; t < n && !batch.dst.empty(); ++t) {
      if (batch.dst[row0 + t] != 0) store_window(seq, t, pool.slot(batch.dst[row0 + t]), pool.dtype);
    }
    store_window(seq, n - 1, live, pool.dtype);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(hybridserve_native, m) {
  m.def("causal_conv1d(Tensor(a!) states, Tensor cu_seqlens, Tensor slots, Tensor? has_initial_state, "
        "Tensor? dst, Tensor x, Tensor weight, Tensor? bias, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("causal_conv1d", &causal_conv1d);
}
