// What the native ops share (kernels/native_ops.py builds SOURCES as one translation unit,
// this file first): vectors of 16 floats, one SiLU formula, and the checked metadata of a varlen batch over a
// state pool (kernels/__init__.py's conventions).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline __attribute__((always_inline)) v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

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

std::vector<int64_t> as_longs(const at::Tensor& t) {
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

bool is_state_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

StatePool state_pool(const char* op, at::Tensor& states) {
  return {op, static_cast<char*>(states.data_ptr()), states.stride(0) * states.element_size(), states.size(0),
          states.scalar_type()};
}

float load_state(const char* p, at::ScalarType dtype, int64_t i) {
  if (dtype == at::kFloat) return reinterpret_cast<const float*>(p)[i];
  if (dtype == at::kBFloat16) return float(reinterpret_cast<const c10::BFloat16*>(p)[i]);
  return float(reinterpret_cast<const c10::Half*>(p)[i]);
}

void store_state(char* p, at::ScalarType dtype, int64_t i, float v) {
  if (dtype == at::kFloat) {
    reinterpret_cast<float*>(p)[i] = v;
  } else if (dtype == at::kBFloat16) {
    reinterpret_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v);
  } else {
    reinterpret_cast<c10::Half*>(p)[i] = c10::Half(v);
  }
}

// Sequence b owns rows cu[b] .. cu[b + 1] - 1 and the live slot slot[b]; initial[b] != 0
// when it has an initial state; dst (empty, or one slot per row): where the state after a
// row is also written (0: nowhere).
struct VarlenBatch {
  std::vector<int64_t> cu, slot, initial, dst;

  int64_t num_seqs() const { return static_cast<int64_t>(slot.size()); }
};

VarlenBatch varlen_batch(const char* op, const at::Tensor& cu_seqlens, const at::Tensor& slots,
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

}  // namespace
