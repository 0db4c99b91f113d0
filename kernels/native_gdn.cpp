// Gated DeltaNet's recurrence on CPU (kernels/gdn/cpu.py): a varlen batch over a state pool,
// in place.
//
// Per value head, with the state S [K, V] (rows of V floats) and one token (decay = exp(g),
// taken here with std::exp so that every caller gets the same decay from the same g):
//     S' = decay * S;   u = beta * (v - S'^T k);   S = S' + k u^T;   o = S^T q.
// Column j of u, S and o depends on column j of S alone, so the kernel walks S in blocks
// of GDN_COLS columns and runs every token of a sequence on a block before the next one: a
// block of K x 64 floats (32 KiB at K = 128) stays in L1 across its two passes (pass 1:
// S'^T k; pass 2: write S, accumulate S^T q) and across tokens. S is read from the pool once
// and written once per call however many tokens the sequence has. Every token runs the
// recurrence -- no chunked form: on one core this loop beats the torch chunked form, and it
// gives a prefill token the same bits as a decode.
//
// Numerics: each column's sums run over the K rows in order (one multiply-add chain per
// lane), so a column's bits depend on neither the block width, the vector width, the number
// of sequences or heads in the call, the thread count, nor how a sequence's tokens are split
// into calls (the state is carried in the pool between calls; a pool of bf16 / fp16 rounds it
// there, as the torch path does). Every CPU path of kernels/gdn (decode, verify, prefill and
// mixed batches, eager or compiled) is this loop, so a token gets the same bits in whichever
// kind of batch it is computed. They are not the torch reference's bits (its products are
// MKL's, its long segments chunked); tests compare the two with a tolerance.
#include "native_common.h"

namespace {

constexpr int GDN_COLS = 64;      // 4 vectors of 16 floats

// The rows of one call: row r of q, k is q + r * qk_row (its key head kh at + kh * K); of
// v, o: + r * vo_row + h * V; of g, beta: + r * gb_row + h.
struct GdnRows {
  const float* q;
  const float* k;
  const float* v;
  const float* g;          // log decay: the loop takes exp (one formula for every caller)
  const float* beta;
  float* o;
  int64_t qk_row, vo_row, gb_row;
};

// One token's inputs for value head h (key head kh), its columns from j0.
struct GdnToken {
  const float* q;
  const float* k;
  const float* v;
  float* o;
  float decay, beta;
};

inline __attribute__((always_inline)) GdnToken gdn_token(const GdnRows& in, int64_t r, int64_t K, int64_t V,
                                                         int64_t h, int64_t kh, int64_t j0) {
  return {in.q + r * in.qk_row + kh * K, in.k + r * in.qk_row + kh * K, in.v + r * in.vo_row + h * V + j0,
          in.o + r * in.vo_row + h * V + j0, std::exp(in.g[r * in.gb_row + h]), in.beta[r * in.gb_row + h]};
}

// Where the states after some rows go: snap[t] (or null) is the head's [K, V] state in a pool
// of `dtype` (float, bfloat16 or half).
struct GdnSnaps {
  char* const* snap;
  at::ScalarType dtype;
};

// Columns [j0, j0 + w) of the fp32 state S into `dst`, a [K, V] state of `dtype`.
void store_cols(char* dst, at::ScalarType dtype, const float* S, int64_t K, int64_t V, int64_t j0, int64_t w) {
  for (int64_t i = 0; i < K; ++i) {
    const float* src = S + i * V + j0;
    if (dtype == at::kFloat) {
      std::memcpy(reinterpret_cast<float*>(dst) + i * V + j0, src, w * sizeof(float));
    } else {
      for (int64_t j = 0; j < w; ++j) store_state(dst, dtype, i * V + j0 + j, src[j]);
    }
  }
}

inline __attribute__((always_inline)) void gdn_snapshot(const GdnSnaps& snaps, int64_t t, const float* S, int64_t K,
                                                        int64_t V, int64_t j0, int64_t w) {
  if (snaps.snap != nullptr && snaps.snap[t] != nullptr) store_cols(snaps.snap[t], snaps.dtype, S, K, V, j0, w);
}

// Columns [j0, j0 + 16 * NV) of one head's state S, rows row0 .. row0 + n - 1 in order.
template <int NV>
inline __attribute__((always_inline)) void gdn_block_vec(float* S, int64_t K, int64_t V, int64_t j0,
                                                         const GdnRows& in, int64_t row0, int64_t n, int64_t h,
                                                         int64_t kh, const GdnSnaps& snaps) {
  for (int64_t t = 0; t < n; ++t) {
    const GdnToken tok = gdn_token(in, row0 + t, K, V, h, kh, j0);
    const float d = tok.decay;
    v16 pred[NV], u[NV], acc[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) pred[c] = v16{};
    for (int64_t i = 0; i < K; ++i) {
      const float ki = tok.k[i];
      const float* row = S + i * V + j0;
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) pred[c] += ki * (d * load16(row + 16 * c));
    }
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      u[c] = tok.beta * (load16(tok.v + 16 * c) - pred[c]);
      acc[c] = v16{};
    }
    for (int64_t i = 0; i < K; ++i) {
      const float ki = tok.k[i], qi = tok.q[i];
      float* row = S + i * V + j0;
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) {
        const v16 s = d * load16(row + 16 * c) + ki * u[c];
        store16(row + 16 * c, s);
        acc[c] += qi * s;
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) store16(tok.o + 16 * c, acc[c]);
    gdn_snapshot(snaps, t, S, K, V, j0, 16 * NV);
  }
}

// The same for the last V % 16 columns, one at a time (the same chains as a vector lane).
inline __attribute__((always_inline)) void gdn_block_tail(float* S, int64_t K, int64_t V, int64_t j0, int64_t w,
                                                          const GdnRows& in, int64_t row0, int64_t n, int64_t h,
                                                          int64_t kh, const GdnSnaps& snaps) {
  for (int64_t t = 0; t < n; ++t) {
    const GdnToken tok = gdn_token(in, row0 + t, K, V, h, kh, j0);
    for (int64_t j = 0; j < w; ++j) {
      float* col = S + j0 + j;
      float pred = 0.0f, acc = 0.0f;
      for (int64_t i = 0; i < K; ++i) pred += tok.k[i] * (tok.decay * col[i * V]);
      const float u = tok.beta * (tok.v[j] - pred);
      for (int64_t i = 0; i < K; ++i) {
        const float s = tok.decay * col[i * V] + tok.k[i] * u;
        col[i * V] = s;
        acc += tok.q[i] * s;
      }
      tok.o[j] = acc;
    }
    gdn_snapshot(snaps, t, S, K, V, j0, w);
  }
}

// Every column block of one head's fp32 state S [K, V], rows row0 .. row0 + n - 1.
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void gdn_head(float* S, int64_t K, int64_t V, const GdnRows& in, int64_t row0, int64_t n, int64_t h, int64_t kh,
              const GdnSnaps& snaps) {
  int64_t j0 = 0;
  for (; j0 + GDN_COLS <= V; j0 += GDN_COLS) gdn_block_vec<GDN_COLS / 16>(S, K, V, j0, in, row0, n, h, kh, snaps);
  switch ((V - j0) / 16) {
    case 3: gdn_block_vec<3>(S, K, V, j0, in, row0, n, h, kh, snaps); j0 += 48; break;
    case 2: gdn_block_vec<2>(S, K, V, j0, in, row0, n, h, kh, snaps); j0 += 32; break;
    case 1: gdn_block_vec<1>(S, K, V, j0, in, row0, n, h, kh, snaps); j0 += 16; break;
    default: break;
  }
  if (j0 < V) gdn_block_tail(S, K, V, j0, V - j0, in, row0, n, h, kh, snaps);
}

void check_gdn_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, int64_t rows, int64_t H, int64_t K, int64_t V) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "gdn_recurrent: inputs must be contiguous fp32 CPU tensors");
  }
  TORCH_CHECK(v.numel() == rows * H * V && g.numel() == rows * H && beta.numel() == rows * H,
              "gdn_recurrent: v / g / beta sizes ", v.sizes(), " / ", g.sizes(), " / ", beta.sizes(),
              " disagree with ", rows, " rows, H=", H, " V=", V);
  if (rows == 0) return;
  const int64_t key_heads = q.numel() / (rows * K);
  TORCH_CHECK(q.sizes() == k.sizes() && key_heads > 0 && q.numel() == rows * key_heads * K &&
                  H % key_heads == 0,
              "gdn_recurrent: q / k ", q.sizes(), " do not fit ", rows, " rows of K=", K, " and H=", H);
}

StatePool gdn_pool(at::Tensor& states) {
  TORCH_CHECK(is_state_dtype(states.scalar_type()) && states.dim() == 4 && states.device().is_cpu() &&
                  states.size(1) > 0 && states.size(2) > 0 && states.size(3) > 0 && states.stride(3) == 1 &&
                  states.stride(2) == states.size(3) && states.stride(1) == states.size(2) * states.size(3),
              "gdn_recurrent: states must be a CPU [S, H, K, V] pool of fp32 / bf16 / fp16 with contiguous "
              "slots, got ", states.sizes(), " ", states.scalar_type());
  return state_pool("gdn_recurrent", states);
}

}  // namespace

// kernels/gdn/cpu.py: the varlen batch of kernels/__init__.py's conventions over a pool,
// in place. Sequence b owns rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1, starts from
// states[slots[b]] (zeros where has_initial_state[b] is false; None: every one present)
// and leaves its last state there; where dst[r] != 0 (dst: None, or one slot per row) the
// state after row r is also written to states[dst[r]]. Sequences run one after another,
// each one's heads in parallel (for_each_head): live slots must be distinct and no snapshot
// slot another sequence's live slot (padding sequences may all use the dummy slot 0).
// -> o [T, H, V].
at::Tensor gdn_recurrent(at::Tensor states, const at::Tensor& cu_seqlens, const at::Tensor& slots,
                         const std::optional<at::Tensor>& has_initial_state, const std::optional<at::Tensor>& dst,
                         const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& beta) {
  const StatePool pool = gdn_pool(states);
  const int64_t H = states.size(1), K = states.size(2), V = states.size(3);
  const int64_t rows = v.numel() / (H * V);
  const VarlenBatch batch = varlen_batch("gdn_recurrent", cu_seqlens, slots, has_initial_state, dst, rows);
  check_gdn_inputs(q, k, v, g, beta, rows, H, K, V);
  at::Tensor out = at::empty({rows, H, V}, v.options());
  const int64_t key_heads = rows > 0 ? q.numel() / (rows * K) : 1, r_heads = H / key_heads;
  const GdnRows in{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                   beta.data_ptr<float>(), out.data_ptr<float>(), key_heads * K, H * V, H};
  const int64_t head_bytes = K * V * states.element_size();
  for_each_head(batch, pool, H, head_bytes,
                [&](char* state, char* const* snaps, int64_t row0, int64_t n, int64_t h, bool initial) {
                  const GdnSnaps head_snaps{snaps, pool.dtype};
                  on_fp32_state(state, pool.dtype, initial, K * V,
                                [&](float* S) { gdn_head(S, K, V, in, row0, n, h, h / r_heads, head_snaps); });
                });
  return out;
}

TORCH_LIBRARY_FRAGMENT(hybridserve_native, m) {
  m.def("gdn_recurrent(Tensor(a!) states, Tensor cu_seqlens, Tensor slots, Tensor? has_initial_state, "
        "Tensor? dst, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("gdn_recurrent", &gdn_recurrent);
}
