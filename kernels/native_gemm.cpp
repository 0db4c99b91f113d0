// Products of a few fp32 rows with a weight matrix, streaming each weight row once
// (few_rows_gemm: native_ops.cpp's expert loop calls it too).
//
// At 1-16 rows a product's time is its weight's bytes, and MKL's small-M sgemm overlaps little
// of its arithmetic with that read (BENCHMARKS.md). Each weight row is read as 16-float vectors against all R rows at once (R accumulators, B
// weight rows in flight, the next B rows prefetched); an output is one dot product -- 16
// lane sums in order of K, then hsum's fixed tree, then the K tail in order -- so its bits
// depend on its own row and weight row alone: not on the row count, the other rows, the
// blocking, or how the columns are split across threads.
#include "native_common.h"

namespace {

typedef float v4 __attribute__((vector_size(16)));
typedef float v8 __attribute__((vector_size(32)));

// hsum of four vectors at once, by hsum's tree: {hsum(a), hsum(b), hsum(c), hsum(d)}, the same bits.
inline __attribute__((always_inline)) v4 hsum4(v16 a, v16 b, v16 c, v16 d) {
  const v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const v8 pairs = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) +       // (b0 + b2, b1 + b3)
                   __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6) + __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7);
}

// y[r * ldy + n0 + b] = x[r] . w[(n0 + b) * ldw], r < R, b < B (the K tail in scalar).
template <int R, int B>
inline __attribute__((always_inline)) void rows_block(const float* const* x, const float* w, int64_t ldw,
                                                      int64_t n0, int64_t K, float* y, int64_t ldy) {
  const int64_t k16 = K & ~int64_t(15);
  v16 acc[B][R];
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[b][r] = v16{};
  for (int64_t k = 0; k < k16; k += 16) {
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) {
      __builtin_prefetch(w + (n0 + B + b) * ldw + k);        // the next block's rows (never faults)
      const v16 wv = load16(w + (n0 + b) * ldw + k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[b][r] += wv * load16(x[r] + k);
    }
  }
  // outputs in (r, b) order, four at a time
  float s[R * B];
  constexpr int FOURS = R * B / 4 * 4;
#pragma GCC unroll 16
  for (int i = 0; i < FOURS; i += 4) {
    const v4 four = hsum4(acc[i % B][i / B], acc[(i + 1) % B][(i + 1) / B], acc[(i + 2) % B][(i + 2) / B],
                          acc[(i + 3) % B][(i + 3) / B]);
    std::memcpy(s + i, &four, sizeof four);
  }
#pragma GCC unroll 16
  for (int i = FOURS; i < R * B; ++i) s[i] = hsum(acc[i % B][i / B]);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) {
      const float* wn = w + (n0 + b) * ldw;
      float sum = s[r * B + b];
      for (int64_t k = k16; k < K; ++k) sum += x[r][k] * wn[k];
      y[r * ldy + n0 + b] = sum;
    }
}

template <int R>
inline __attribute__((always_inline)) void rows_gemm(const float* const* x, const float* w, int64_t ldw,
                                                     int64_t N, int64_t K, float* y, int64_t ldy) {
  constexpr int B = R <= 4 ? 4 : R <= 8 ? 2 : 1;   // B x R accumulators stay in registers
  int64_t n = 0;
  for (; n + B <= N; n += B) rows_block<R, B>(x, w, ldw, n, K, y, ldy);
  for (; n < N; ++n) rows_block<R, 1>(x, w, ldw, n, K, y, ldy);
}

}  // namespace

// y [rows, ldy] = x @ w^T for rows <= SMALL_ROWS: x[r] points at row r's K floats, w is
// N rows of K floats, ldw apart. One binary, the widest vectors the machine has.
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void few_rows_gemm(const float* const* x, int64_t rows, const float* w, int64_t ldw, int64_t N,
                   int64_t K, float* y, int64_t ldy) {
  switch (rows) {
    case 1: rows_gemm<1>(x, w, ldw, N, K, y, ldy); break;
    case 2: rows_gemm<2>(x, w, ldw, N, K, y, ldy); break;
    case 3: rows_gemm<3>(x, w, ldw, N, K, y, ldy); break;
    case 4: rows_gemm<4>(x, w, ldw, N, K, y, ldy); break;
    case 5: rows_gemm<5>(x, w, ldw, N, K, y, ldy); break;
    case 6: rows_gemm<6>(x, w, ldw, N, K, y, ldy); break;
    case 7: rows_gemm<7>(x, w, ldw, N, K, y, ldy); break;
    case 8: rows_gemm<8>(x, w, ldw, N, K, y, ldy); break;
    case 9: rows_gemm<9>(x, w, ldw, N, K, y, ldy); break;
    case 10: rows_gemm<10>(x, w, ldw, N, K, y, ldy); break;
    case 11: rows_gemm<11>(x, w, ldw, N, K, y, ldy); break;
    case 12: rows_gemm<12>(x, w, ldw, N, K, y, ldy); break;
    case 13: rows_gemm<13>(x, w, ldw, N, K, y, ldy); break;
    case 14: rows_gemm<14>(x, w, ldw, N, K, y, ldy); break;
    case 15: rows_gemm<15>(x, w, ldw, N, K, y, ldy); break;
    case 16: rows_gemm<16>(x, w, ldw, N, K, y, ldy); break;
    default: TORCH_CHECK(false, "few_rows_gemm: ", rows, " rows (at most ", SMALL_ROWS, ")");
  }
}


// More than SMALL_ROWS rows, SMALL_ROWS at a time against column blocks of COLS weight rows
// (each block read by every row chunk while it is in cache); y [rows, N].
static void many_rows_gemm(const float* const* x, int64_t rows, const float* w, int64_t ldw, int64_t N, int64_t K,
                    float* y) {
  constexpr int64_t COLS = 64;
  at::parallel_for(0, (N + COLS - 1) / COLS, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = b0 * COLS; c0 < std::min(N, b1 * COLS); c0 += COLS)
      for (int64_t r0 = 0; r0 < rows; r0 += SMALL_ROWS)
        few_rows_gemm(x + r0, std::min(SMALL_ROWS, rows - r0), w + c0 * ldw, ldw, std::min(COLS, N - c0), K,
                      y + r0 * N + c0, N);
  });
}

// kernels/dense.py's few-rows product: x [..., K] fp32, weight [N, K] fp32 with contiguous
// rows, bias [N] fp32 or None -> [..., N] = x @ weight^T (+ bias, added to each finished dot
// product). More than SMALL_ROWS rows (dense.py's batch-invariant mode) go SMALL_ROWS at a
// time: every output is still its own row's dot product, so its bits ignore the row count.
at::Tensor few_rows_linear(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  rows_contiguous(weight) && x_in.dim() >= 1 && x_in.size(-1) == weight.size(1),
              "few_rows_linear: fp32 x [..., K] and weight [N, K] with contiguous rows expected, got ",
              x_in.sizes(), " ", x_in.scalar_type(), " and ", weight.sizes(), " ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t rows = c10::multiply_integers(x_in.sizes().begin(), x_in.sizes().end() - 1);   // K = 0: zeros
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N),
              "few_rows_linear: an fp32 bias of ", N, " elements expected");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  if (rows == 0 || N == 0) return y;
  const float* few[SMALL_ROWS];
  std::vector<const float*> many(rows > SMALL_ROWS ? rows : 0);
  const float** xr = rows <= SMALL_ROWS ? few : many.data();
  for (int64_t r = 0; r < rows; ++r) xr[r] = x.data_ptr<float>() + r * K;
  const float* w = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldw = weight.stride(0);
  if (rows <= SMALL_ROWS) {
    at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
      few_rows_gemm(xr, rows, w + n0 * ldw, ldw, n1 - n0, K, yp + n0, N);
    });
  } else {
    many_rows_gemm(xr, rows, w, ldw, N, K, yp);
  }
  if (bias.has_value()) {
    const at::Tensor b = bias->contiguous();
    const float* bp = b.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < N; ++n) yp[r * N + n] += bp[n];
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(hybridserve_native, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
