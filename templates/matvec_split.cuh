// Matvec rows split along K (included after common.cuh: MatvecBatch, fma_batch, ld_stream,
// warp_sum). The matvec and matvec_residual kinds hand the rows past a tile's last full round of
// warps to matvec_split_rows (FUSEC_SPLIT_LAST_ROUND, fusec/cuda/knobs.py).

// A part of one row's dot by one warp: warp steps [s0, s1) of w[0:K] (each 32 lanes x 16 bytes)
// and, with `tail`, the lane chunks past the last full step (K not a multiple of a step),
// FUSEC_LOADS_IN_FLIGHT loads per lane in flight; every lane gets the warp's sum. K a multiple of
// 16 bytes (MatvecBatch::VEC).
template <typename TW, typename TS, int K>
__device__ __forceinline__ float dot_steps(const TW* __restrict__ w, const TS* __restrict__ xs, int lane, int s0,
                                           int s1, bool tail) {
  using M = MatvecBatch<TW, K, 1>;
  constexpr int V = M::V, STEP = M::STEP, B = FUSEC_LOADS_IN_FLIGHT;
  float acc[1] = {0.f};
  for (int s = s0; s < s1; s += B) {   // the same trip count in every lane
    uint4 raw[B];
#pragma unroll
    for (int b = 0; b < B; ++b) raw[b] = s + b < s1 ? ld_stream(w + (s + b) * STEP + lane * V) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (s + b >= s1) break;   // (uniform: no shared-memory read past the row)
      const uint4 one[1][1] = { {raw[b]} };
      fma_batch<TW, TS, 1, 1>(one, xs, (s + b) * STEP + lane * V, acc);
    }
  }
  if constexpr (M::TAIL > 0) {
    if (tail && lane < M::TAIL) {
      const uint4 one[1][1] = { {ld_stream(w + M::NK * STEP + lane * V)} };
      fma_batch<TW, TS, 1, 1>(one, xs, M::NK * STEP + lane * V, acc);
    }
  }
  return warp_sum(acc[0]);
}

// The first row of a matvec tile [r0, r1) that matvec_split_rows takes (r1 where none): with
// FUSEC_SPLIT_LAST_ROUND, the rows past the tile's last full round of warps (one row per warp),
// when they are at most half the warps and a row takes more than one batch of loads. The rows
// before it go one per warp as before.
template <typename TW, int K>
__device__ __forceinline__ int matvec_split_from(int r0, int r1) {
  using M = MatvecBatch<TW, K, 1>;
  if constexpr (FUSEC_SPLIT_LAST_ROUND && M::VEC && M::NK > M::B) {
    const int nw = blockDim.x >> 5, rem = (r1 - r0) % nw;
    return 2 * rem <= nw ? r1 - rem : r1;
  } else {
    return r1;
  }
}

// Rows [r0, r1) of a matvec tile (fewer than half the CTA's warps: matvec_split_from), each split
// along K over nw / (r1 - r0) warps in ranges of whole warp steps (dot_steps); the parts' sums
// are added in shared memory in their order and emit(r, d, pv) gets each row's dot d from one
// thread, pv = pre(r) loaded by that thread before the dot (an epilogue operand: a bias, a
// residual). All threads of the CTA call it. Why: a tile of 17-18 rows of Gemma-2-2B's
// 9216-wide down projection ran its last one or two rows on one warp each, 4.5 dependent
// batches of loads while 14 warps idled.
template <typename TW, typename TS, int K, typename P, typename F>
__device__ __forceinline__ void matvec_split_rows(const TW* __restrict__ w, const TS* __restrict__ xs, int r0, int r1,
                                           P&& pre, F&& emit) {
  if (r0 >= r1) return;   // (the same in every thread)
  using M = MatvecBatch<TW, K, 1>;
  __shared__ float red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int rem = r1 - r0, per = nw / rem, j = warp / per, part = warp % per;
  const float pv = threadIdx.x < rem ? pre(r0 + (int)threadIdx.x) : 0.f;
  if (j < rem) {
    const float d = dot_steps<TW, TS, K>(w + (size_t)(r0 + j) * K, xs, lane, part * M::NK / per,
                                         (part + 1) * M::NK / per, part == per - 1);
    if (lane == 0) red[warp] = d;
  }
  __syncthreads();
  if (threadIdx.x < rem) {
    float d = 0.f;
    for (int p = 0; p < per; ++p) d += red[threadIdx.x * per + p];
    emit(r0 + (int)threadIdx.x, d, pv);
  }
  __syncthreads();   // red is free for the next tile's rows
}
