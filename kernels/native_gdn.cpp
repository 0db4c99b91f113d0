// Gated DeltaNet's per-token recurrence on CPU (kernels/gdn/cpu.py), fp32, states in place.
// Appended to native_ops.cpp by kernels/native_ops.py (one extension, one build).
#include <cmath>
//
// Per value head, with the state S [K, V] (rows of V floats) and one token (decay = exp(g),
// taken here with std::exp so that every caller gets the same decay from the same g):
//     S' = decay * S;   u = beta * (v - S'^T k);   S = S' + k u^T;   o = S^T q.
// Column j of u, S and o depends on column j of S alone, so the kernel walks S in blocks
// of COLS columns and runs every token of the head on a block before the next one: a block
// of K x COLS floats (32 KiB at K = 128) stays in L1 across its two passes (pass 1: S'^T k;
// pass 2: write S, accumulate S^T q) and across tokens, and S is read from memory once and
// written once per call however many tokens it has. The torch path reads it five times
// (gather, decay, two products, scatter) per token.
//
// Numerics: each column's sums run over the K rows in order (one multiply-add chain per
// lane), so a column's bits depend on neither the block width, the vector width, the number
// of sequences or heads in the call, the thread count, nor whether its tokens arrive in one
// call or several (the state is carried in fp32 between calls). Every CPU path of kernels/gdn
// (decode, verify, the recurrent segments of a varlen batch) runs this loop, so a token gets
// the same bits in whichever kind of batch it is computed. They are not the torch
// reference's bits (its products are MKL's); tests compare the two with a tolerance.
namespace {

constexpr int GDN_COLS = 64;      // 4 vectors of 16 floats

// The rows of one call: row r of q, k is q + r * qk_row (its head h / r_heads at
// + (h / r_heads) * K); of v, o: + r * vo_row + h * V; of g, beta: + r * gb_row + h.
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

// Columns [j0, j0 + w) of S into the snapshot of token t, if it has one.
inline __attribute__((always_inline)) void gdn_snapshot(float* const* snap, int64_t t, const float* S, int64_t K,
                                                        int64_t V, int64_t j0, int64_t w) {
  if (snap == nullptr || snap[t] == nullptr) return;
  for (int64_t i = 0; i < K; ++i) std::memcpy(snap[t] + i * V + j0, S + i * V + j0, w * sizeof(float));
}

typedef float gdn_v16 __attribute__((vector_size(64)));

inline __attribute__((always_inline)) gdn_v16 gdn_load(const float* p) {
  gdn_v16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline __attribute__((always_inline)) void gdn_store(float* p, gdn_v16 x) { std::memcpy(p, &x, sizeof x); }

// Columns [j0, j0 + 16 * NV) of one head's state S, tokens rows[0..T). snap[t] (or null):
// where the state after token t is copied (same layout as S).
template <int NV>
inline __attribute__((always_inline)) void gdn_block_vec(float* S, int64_t K, int64_t V, int64_t j0,
                                                         const GdnRows& in, const int64_t* rows, int64_t T,
                                                         int64_t h, int64_t kh, float* const* snap) {
  for (int64_t t = 0; t < T; ++t) {
    const GdnToken tok = gdn_token(in, rows[t], K, V, h, kh, j0);
    const float d = tok.decay;
    gdn_v16 pred[NV], u[NV], acc[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) pred[n] = gdn_v16{};
    for (int64_t i = 0; i < K; ++i) {
      const float ki = tok.k[i];
      const float* row = S + i * V + j0;
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) pred[n] += ki * (d * gdn_load(row + 16 * n));
    }
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) {
      u[n] = tok.beta * (gdn_load(tok.v + 16 * n) - pred[n]);
      acc[n] = gdn_v16{};
    }
    for (int64_t i = 0; i < K; ++i) {
      const float ki = tok.k[i], qi = tok.q[i];
      float* row = S + i * V + j0;
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) {
        const gdn_v16 s = d * gdn_load(row + 16 * n) + ki * u[n];
        gdn_store(row + 16 * n, s);
        acc[n] += qi * s;
      }
    }
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) gdn_store(tok.o + 16 * n, acc[n]);
    gdn_snapshot(snap, t, S, K, V, j0, 16 * NV);
  }
}

// The same for the last V % 16 columns, one at a time (the same chains as a vector lane).
inline __attribute__((always_inline)) void gdn_block_tail(float* S, int64_t K, int64_t V, int64_t j0, int64_t w,
                                                          const GdnRows& in, const int64_t* rows, int64_t T,
                                                          int64_t h, int64_t kh, float* const* snap) {
  for (int64_t t = 0; t < T; ++t) {
    const GdnToken tok = gdn_token(in, rows[t], K, V, h, kh, j0);
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
    gdn_snapshot(snap, t, S, K, V, j0, w);
  }
}

// Every column block of one head's state S [K, V], tokens rows[0..T).
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void gdn_head(float* S, int64_t K, int64_t V, const GdnRows& in, const int64_t* rows, int64_t T, int64_t h,
              int64_t kh, float* const* snap) {
  int64_t j0 = 0;
  for (; j0 + GDN_COLS <= V; j0 += GDN_COLS) gdn_block_vec<GDN_COLS / 16>(S, K, V, j0, in, rows, T, h, kh, snap);
  switch ((V - j0) / 16) {
    case 3: gdn_block_vec<3>(S, K, V, j0, in, rows, T, h, kh, snap); j0 += 48; break;
    case 2: gdn_block_vec<2>(S, K, V, j0, in, rows, T, h, kh, snap); j0 += 32; break;
    case 1: gdn_block_vec<1>(S, K, V, j0, in, rows, T, h, kh, snap); j0 += 16; break;
    default: break;
  }
  if (j0 < V) gdn_block_tail(S, K, V, j0, V - j0, in, rows, T, h, kh, snap);
}

void check_gdn_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, int64_t H, int64_t K, int64_t V) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "gdn_recurrent: inputs must be contiguous fp32 CPU tensors");
  }
  const int64_t rows = v.numel() / (H * V);
  TORCH_CHECK(v.numel() == rows * H * V && g.numel() == rows * H && beta.numel() == rows * H,
              "gdn_recurrent: v / g / beta sizes disagree with H=", H, " V=", V);
  if (rows == 0) return;
  const int64_t key_heads = q.numel() / (rows * K);
  TORCH_CHECK(q.sizes() == k.sizes() && key_heads > 0 && q.numel() == rows * key_heads * K &&
                  H % key_heads == 0,
              "gdn_recurrent: q / k ", q.sizes(), " do not fit ", rows, " rows of K=", K, " and H=", H);
}

// Every head of `num_seqs` sequences of T rows each (rows b*T .. b*T+T-1), sequence b's
// state at seq_state[b] ([H, K, V]); snaps[b*T + t] (or null) receives the state after row t.
at::Tensor gdn_run(const std::vector<float*>& seq_state, const std::vector<float*>& snaps, int64_t T,
                   const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta, int64_t H, int64_t K, int64_t V) {
  check_gdn_inputs(q, k, v, g, beta, H, K, V);
  const int64_t num_seqs = static_cast<int64_t>(seq_state.size()), rows = num_seqs * T;
  TORCH_CHECK(v.numel() == rows * H * V, "gdn_recurrent: ", v.numel() / (H * V), " rows for ",
              num_seqs, " sequences of ", T);
  at::Tensor out = at::empty({rows, H, V}, v.options());
  const int64_t key_heads = rows > 0 ? q.numel() / (rows * K) : 1, r_heads = H / key_heads;
  const GdnRows in{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                   beta.data_ptr<float>(), out.data_ptr<float>(), key_heads * K, H * V, H};
  const int64_t head = K * V;
  // Sequences one after another (padding sequences may share the dummy slot 0), heads in
  // parallel: a head's state and outputs are its own.
  std::vector<int64_t> row_ids(T);
  std::vector<float*> head_snaps(T);
  for (int64_t b = 0; b < num_seqs; ++b) {
    for (int64_t t = 0; t < T; ++t) row_ids[t] = b * T + t;
    const bool any_snap = !snaps.empty();
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      std::vector<float*> local(T);
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t t = 0; t < T && any_snap; ++t) {
          float* base = snaps[b * T + t];
          local[t] = base == nullptr ? nullptr : base + h * head;
        }
        gdn_head(seq_state[b] + h * head, K, V, in, row_ids.data(), T, h, h / r_heads,
                 any_snap ? local.data() : nullptr);
      }
    });
  }
  return out;
}

float* state_row(at::Tensor& states, int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < states.size(0), "gdn_recurrent: slot ", slot, " of ", states.size(0));
  return states.data_ptr<float>() + slot * states.stride(0);
}

void check_states(const at::Tensor& states) {
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 4 &&
                  states.size(1) > 0 && states.size(2) > 0 && states.size(3) > 0,
              "gdn_recurrent: states must be a contiguous fp32 [S, H, K, V] tensor, got ", states.sizes());
}

}  // namespace

// kernels/gdn/cpu.py pool form (decode, verify): B = slots.numel() sequences of T = rows / B
// rows each, the live state of sequence b at states[slots[b]], updated in place; dst [B*T]
// (or None): where dst[r] != 0 the state after row r is also written to states[dst[r]].
at::Tensor gdn_recurrent_pool(at::Tensor states, const at::Tensor& slots, const std::optional<at::Tensor>& dst,
                              const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta) {
  check_states(states);
  const int64_t H = states.size(1), K = states.size(2), V = states.size(3);
  const at::Tensor slot_ids = slots.to(at::kLong).contiguous();
  const int64_t num_seqs = slot_ids.numel(), rows = v.numel() / (H * V);
  TORCH_CHECK(num_seqs > 0 ? rows % num_seqs == 0 : rows == 0, "gdn_recurrent: ", rows,
              " rows for ", num_seqs, " sequences");
  const int64_t T = num_seqs > 0 ? rows / num_seqs : 0;
  std::vector<float*> seq_state(num_seqs), snaps;
  for (int64_t b = 0; b < num_seqs; ++b) seq_state[b] = state_row(states, slot_ids.data_ptr<int64_t>()[b]);
  if (dst.has_value()) {
    const at::Tensor d = dst->to(at::kLong).contiguous();
    TORCH_CHECK(d.numel() == rows, "gdn_recurrent: ", d.numel(), " snapshot slots for ", rows, " rows");
    snaps.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = d.data_ptr<int64_t>()[r];
      snaps[r] = slot == 0 ? nullptr : state_row(states, slot);
    }
  }
  return gdn_run(seq_state, snaps, T, q, k, v, g, beta, H, K, V);
}

// kernels/gdn/cpu.py dense form (a varlen batch's recurrent segments): s [n, H, K, V], the
// states of n sequences of L = rows / n rows each, updated in place; no snapshots.
at::Tensor gdn_recurrent_dense(at::Tensor s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta) {
  check_states(s);
  const int64_t n = s.size(0), H = s.size(1), K = s.size(2), V = s.size(3);
  const int64_t rows = v.numel() / (H * V);
  TORCH_CHECK(n > 0 ? rows % n == 0 : rows == 0, "gdn_recurrent: ", rows, " rows for ", n, " states");
  std::vector<float*> seq_state(n);
  for (int64_t b = 0; b < n; ++b) seq_state[b] = state_row(s, b);
  return gdn_run(seq_state, {}, n > 0 ? rows / n : 0, q, k, v, g, beta, H, K, V);
}

TORCH_LIBRARY_FRAGMENT(hybridserve_native, m) {
  m.def("gdn_recurrent_pool(Tensor(a!) states, Tensor slots, Tensor? dst, Tensor q, Tensor k, Tensor v, "
        "Tensor g, Tensor beta) -> Tensor");
  m.def("gdn_recurrent_dense(Tensor(a!) s, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("gdn_recurrent_pool", &gdn_recurrent_pool);
  m.impl("gdn_recurrent_dense", &gdn_recurrent_dense);
}
