// What the native ops' sources share (kernels/native_ops.py builds them into one library):
// vectors of 16 floats, one SiLU formula, and the checked metadata of a varlen batch over a
// state pool (kernels/__init__.py's conventions).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// Defined once each (their clones for each vector width are one ifunc): native_fused.cpp's
// y row r = silu(g row r) * u row r (rows of D floats ldg / ldu apart, y contiguous), and
// native_gemm.cpp's y [rows, ldy] = x @ w^T of at most SMALL_ROWS rows.
void silu_mul_rows(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t rows, int64_t D, float* y);
void few_rows_gemm(const float* const* x, int64_t rows, const float* w, int64_t ldw, int64_t N, int64_t K,
                   float* y, int64_t ldy);

namespace {

constexpr int64_t SMALL_ROWS = 16;       // the few-rows products' (native_gemm.cpp) largest batch

inline bool rows_contiguous(const at::Tensor& w) { return w.stride(-1) == 1; }

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline __attribute__((always_inline)) v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// The sum of a vector's lanes, by a fixed tree.
inline __attribute__((always_inline)) float hsum(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// silu(x) = x / (1 + exp(-x)), exp by range reduction (x = n ln2 + r, |r| <= ln2 / 2) and a
// degree-6 polynomial: within ~2 ulp of libm, and one formula for every element, where ATen's
// silu takes a scalar formula for the ragged end of a vectorised loop (other bits for the
// same value, depending on where the element sits). Lanes are independent.
template <typename F, typename I>
inline __attribute__((always_inline)) F silu_of(F x) {
  const F lo = F{} - 87.3f, hi = F{} + 88.7f;
  F a = -x;
  a = a < lo ? lo : a;                           // NaN stays NaN (both compares false)
  a = a > hi ? hi : a;
  const F shifter = F{} + 12582912.0f;           // 1.5 * 2^23: adding it rounds to an integer
  const F t = a * 1.44269504f + shifter;
  const F n = t - shifter;
  const F r = (a - n * 0.693145752f) - n * 1.42860677e-06f;
  F p = r * (1.0f / 720) + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  I bits;
  std::memcpy(&bits, &t, sizeof bits);
  I shifter_bits;
  std::memcpy(&shifter_bits, &shifter, sizeof shifter_bits);
  const I scale_bits = (bits - shifter_bits + 127) << 23;   // 2^n
  F scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return x / (1.0f + p * scale);
}

// out[i] = silu(g[i]) * u[i] for i < n, or silu(g[i]) without u (the vector formula on full
// lanes, the same formula one element at a time on the tail).
inline __attribute__((always_inline)) void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const int64_t n16 = n & ~int64_t(15);
  for (int64_t i = 0; i < n16; i += 16) {
    const v16 s = silu_of<v16, v16i>(load16(g + i));
    store16(out + i, u == nullptr ? s : s * load16(u + i));
  }
  for (int64_t i = n16; i < n; ++i) {
    const float s = silu_of<float, int32_t>(g[i]);
    out[i] = u == nullptr ? s : s * u[i];
  }
}

inline std::vector<int64_t> as_longs(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// A pool [S, ...] of fp32 / bf16 / fp16 states whose slots are contiguous (checked by the op).
struct StatePool {
  const char* op;
  char* base;
  int64_t slot_bytes, num_slots;
  at::ScalarType dtype;

  char* slot(int64_t s) const {
    TORCH_CHECK(s >= 0 && s < num_slots, op, ": slot ", s, " of ", num_slots);
    return base + s * slot_bytes;
  }
};

inline bool is_state_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

inline StatePool state_pool(const char* op, at::Tensor& states) {
  return {op, static_cast<char*>(states.data_ptr()), states.stride(0) * states.element_size(), states.size(0),
          states.scalar_type()};
}

inline float load_state(const char* p, at::ScalarType dtype, int64_t i) {
  if (dtype == at::kFloat) return reinterpret_cast<const float*>(p)[i];
  if (dtype == at::kBFloat16) return float(reinterpret_cast<const c10::BFloat16*>(p)[i]);
  return float(reinterpret_cast<const c10::Half*>(p)[i]);
}

inline void store_state(char* p, at::ScalarType dtype, int64_t i, float v) {
  if (dtype == at::kFloat) {
    reinterpret_cast<float*>(p)[i] = v;
  } else if (dtype == at::kBFloat16) {
    reinterpret_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v);
  } else {
    reinterpret_cast<c10::Half*>(p)[i] = c10::Half(v);
  }
}

// run(S) on one head's state of `numel` floats in a pool of `dtype`: in place when fp32,
// else on an fp32 copy rounded back afterwards; S starts at zeros without an initial state.
template <typename Run>
void on_fp32_state(char* state, at::ScalarType dtype, bool initial, int64_t numel, Run&& run) {
  if (dtype == at::kFloat) {
    float* S = reinterpret_cast<float*>(state);
    if (!initial) std::memset(S, 0, numel * sizeof(float));
    run(S);
    return;
  }
  std::vector<float> copy(numel, 0.0f);
  for (int64_t e = 0; initial && e < numel; ++e) copy[e] = load_state(state, dtype, e);
  run(copy.data());
  for (int64_t e = 0; e < numel; ++e) store_state(state, dtype, e, copy[e]);
}

// Sequence b owns rows cu[b] .. cu[b + 1] - 1 and the live slot slot[b]; initial[b] != 0
// when it has an initial state; dst (empty, or one slot per row): where the state after a
// row is also written (0: nowhere).
struct VarlenBatch {
  std::vector<int64_t> cu, slot, initial, dst;

  int64_t num_seqs() const { return static_cast<int64_t>(slot.size()); }
};

inline VarlenBatch varlen_batch(const char* op, const at::Tensor& cu_seqlens, const at::Tensor& slots,
                         const std::optional<at::Tensor>& has_initial_state, const std::optional<at::Tensor>& dst,
                         int64_t rows) {
  VarlenBatch b{as_longs(cu_seqlens), as_longs(slots), {}, {}};
  const int64_t n = b.num_seqs();
  TORCH_CHECK(static_cast<int64_t>(b.cu.size()) == n + 1 && b.cu[0] == 0 && b.cu[n] == rows &&
                  std::is_sorted(b.cu.begin(), b.cu.end()),
              op, ": cu_seqlens ", cu_seqlens.sizes(), " must rise from 0 to the ", rows,
              " rows, one entry more than the ", n, " slots");
  b.initial = has_initial_state.has_value() ? as_longs(*has_initial_state) : std::vector<int64_t>(n, 1);
  if (dst.has_value()) b.dst = as_longs(*dst);
  TORCH_CHECK(static_cast<int64_t>(b.initial.size()) == n &&
                  (!dst.has_value() || static_cast<int64_t>(b.dst.size()) == rows),
              op, ": has_initial_state / dst sizes do not fit ", n, " sequences of ", rows, " rows");
  return b;
}

// For each sequence with rows, each of its H heads in parallel (a head's state and outputs
// are its own): fn(head h's state in the pool, the head's snapshot targets after each row
// (null, or null entries where a row has none), first row, rows, h, has an initial state).
// Sequences run one after another: padding sequences may share the dummy slot 0.
template <typename Fn>
void for_each_head(const VarlenBatch& batch, const StatePool& pool, int64_t H, int64_t head_bytes, Fn&& fn) {
  for (int64_t b = 0; b < batch.num_seqs(); ++b) {
    const int64_t row0 = batch.cu[b], n = batch.cu[b + 1] - batch.cu[b];
    if (n == 0) continue;                          // untouched, as the conventions say
    char* live = pool.slot(batch.slot[b]);
    std::vector<char*> snap_rows;
    for (int64_t t = 0; t < n && !batch.dst.empty(); ++t) {
      snap_rows.push_back(batch.dst[row0 + t] == 0 ? nullptr : pool.slot(batch.dst[row0 + t]));
    }
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      std::vector<char*> head_snaps(snap_rows.size());
      for (int64_t h = h0; h < h1; ++h) {
        for (size_t t = 0; t < snap_rows.size(); ++t) {
          head_snaps[t] = snap_rows[t] == nullptr ? nullptr : snap_rows[t] + h * head_bytes;
        }
        fn(live + h * head_bytes, snap_rows.empty() ? nullptr : head_snaps.data(), row0, n, h,
           batch.initial[b] != 0);
      }
    });
  }
}

}  // namespace
