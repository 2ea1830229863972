// The split-KV merge (log-sum-exp of the partials) and the attention helpers its callers share:
// the output row of a K-token step, Gemma-2's logit softcap. Included after common.cuh
// (from_f, the knobs) by kernel.cu.j2.

// Log-sum-exp merge of split-KV partials (o_part [H][NC][D], ml [H][NC][{m, l}], fp32, read
// from L2: other CTAs wrote them) for query heads [h0, h1), over the first na of each head's NC
// (default all; FUSEC_ATTN_SPLIT_ROWS: the active splits, the others hold an earlier step's):
// M = max m_c, w_c = exp(m_c - M) (0 for an empty chunk), out = sum w_c o_c / sum w_c l_c.
// attention_reduce and the last-tile merge of attention_partial. FUSEC_MERGE_ONE_PASS 1: a thread
// issues the loads of up to 32 partials ({m, l} as one float2, o) before any arithmetic and weighs
// them without a branch (exp(-inf) = 0): one L2 round trip for na <= 32; past 32 (4 or fewer KV
// heads on 132 SMs and more than 32 active splits) the max over batches of 16 m loads, then the
// sums over batches of 16, 2 * ceil(na / 16) round trips (before: the loop of 0 below, one branch
// and loads per partial). 0: the max pass, then a loop whose loads follow a branch per chunk.
// Same sums in the same order either way. With FUSEC_MERGE_LANES 1 and NC > 16 (the default for
// one or few KV heads), merge_split_kv_lanes instead: lanes share an element, each with at most
// 16 partials in flight (sums in another order: each block under its own max, then combined).
// OHQ > 0 (a step of QK query tokens whose output HF transposes: attention's out_tokens): query
// row h = (b * OHQ + hh) * QK + k of [B, OHQ, QK, D] goes to row (b * QK + k) * OHQ + hh of the
// output [B, QK, OHQ, D] (attention_out_row); 0: row h.
template <int QK, int OHQ>
__device__ __forceinline__ int attention_out_row(int h) {
  if constexpr (OHQ > 0 && QK > 1) return ((h / (OHQ * QK)) * QK + h % QK) * OHQ + (h / QK) % OHQ;
  else return h;
}

// Gemma-2's attention logit softcap of a scaled score x, cap * tanh(x / cap), where the op has one
// (SC; fusec.sdpa's softcap, HF Gemma2's eager attention: before the mask); x itself otherwise
template <int SC>
__device__ __forceinline__ float attention_softcap(float x, float cap) {
  if constexpr (SC != 0) return cap * tanhf(x / cap);
  else return (void)cap, x;
}

// One batch of merge_split_kv: partials [c0, c0 + NB) of head h (those past na: m = -inf, l = o = 0),
// element t of o, every load issued before any use ({m, l} as one float2: 8-byte aligned)
template <int NB, int D, int NC>
__device__ __forceinline__ void merge_load(const float* __restrict__ o_part, const float* __restrict__ ml, int h,
                                           int t, int c0, int na, float (&mv)[NB], float (&lv)[NB], float (&ov)[NB]) {
#pragma unroll
  for (int c = 0; c < NB; ++c) {
    if (c0 + c < na) {
      const float2 mlc = __ldcg(reinterpret_cast<const float2*>(ml) + h * NC + c0 + c);
      mv[c] = mlc.x;
      lv[c] = mlc.y;
      ov[c] = __ldcg(o_part + (h * NC + c0 + c) * D + t);
    } else {
      mv[c] = -INFINITY;
      lv[c] = 0.f;
      ov[c] = 0.f;
    }
  }
}

// The batch's terms of merge_split_kv's sums under the max m, without a branch (an empty or
// inactive partial: exp(-inf) = 0)
template <int NB>
__device__ __forceinline__ void merge_weigh(const float (&mv)[NB], const float (&lv)[NB], const float (&ov)[NB],
                                            float m, float& num, float& den) {
#pragma unroll
  for (int c = 0; c < NB; ++c) {
    const float w = expf(mv[c] == -INFINITY ? -INFINITY : mv[c] - m);
    num += w * ov[c];
    den += w * lv[c];
  }
}

// Two partial merges (max m, sum of weighted o, sum of weighted l, each under its own max) as one
// under the larger max; an empty side (m = -inf) weighs 0
__device__ __forceinline__ void merge_combine(float& m, float& num, float& den, float m2, float num2, float den2) {
  const float mx = fmaxf(m, m2);
  const float a = m == -INFINITY ? 0.f : expf(m - mx), b = m2 == -INFINITY ? 0.f : expf(m2 - mx);
  num = num * a + num2 * b;
  den = den * a + den2 * b;
  m = mx;
}

// FUSEC_MERGE_LANES: the lanes that share one output element of a merge of NC > 16 partials
// (consecutive lanes of a warp, partials split in contiguous blocks), so that each lane's block
// is at most 16 partials (one L2 round trip; at most 8 lanes)
template <int NC>
__host__ __device__ constexpr int merge_lanes() { return NC <= 16 ? 1 : NC <= 32 ? 2 : NC <= 64 ? 4 : 8; }

// merge_split_kv with S = merge_lanes<NC>() lanes per output element: lane s merges partials
// [s * NL, (s + 1) * NL) (those below na) in batches of 16 loads, each batch under its own max
// (merge_combine), then the S lanes combine by shuffles and the first stores. Every lane of a warp
// runs the same iterations (the shuffles need all 32).
template <typename TO, int D, int NC, int QK, int OHQ>
__device__ __forceinline__ void merge_split_kv_lanes(const float* __restrict__ o_part, const float* __restrict__ ml,
                                                     TO* __restrict__ out, int h0, int h1, int na) {
  constexpr int S = merge_lanes<NC>(), NL = (NC + S - 1) / S, NB = 16;
  const int n = (h1 - h0) * D * S;
  for (int base = 0; base < n; base += blockDim.x) {
    const int idx = base + threadIdx.x, s = idx % S;
    const bool valid = idx < n;
    const int h = h0 + (idx / S) / D, t = (idx / S) % D;
    const int c_end = valid ? min(na, (s + 1) * NL) : 0;
    float m = -INFINITY, num = 0.f, den = 0.f;
    for (int c0 = s * NL; c0 < c_end; c0 += NB) {
      float mv[NB], lv[NB], ov[NB];
      merge_load<NB, D, NC>(o_part, ml, h, t, c0, c_end, mv, lv, ov);
      float bm = -INFINITY;
#pragma unroll
      for (int c = 0; c < NB; ++c) bm = fmaxf(bm, mv[c]);
      float bn = 0.f, bd = 0.f;
      merge_weigh<NB>(mv, lv, ov, bm, bn, bd);
      merge_combine(m, num, den, bm, bn, bd);
    }
#pragma unroll
    for (int o = S / 2; o > 0; o >>= 1)
      merge_combine(m, num, den, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, num, o),
                    __shfl_xor_sync(0xffffffffu, den, o));
    if (valid && s == 0) out[attention_out_row<QK, OHQ>(h) * D + t] = from_f<TO>(den > 0.f ? num / den : 0.f);
  }
}

template <typename TO, int D, int NC, int QK = 1, int OHQ = 0>
__device__ __forceinline__ void merge_split_kv(const float* __restrict__ o_part, const float* __restrict__ ml,
                                               TO* __restrict__ out, int h0, int h1, int na = NC) {
  constexpr int NP = NC < 32 ? NC : 32;
  if constexpr (NC > 16) {
    if (FUSEC_MERGE_ONE_PASS && FUSEC_MERGE_LANES) {   // lanes share an element: one round trip each
      merge_split_kv_lanes<TO, D, NC, QK, OHQ>(o_part, ml, out, h0, h1, na);
      return;
    }
  }
  if (FUSEC_MERGE_ONE_PASS && na <= NP) {   // one batch: its loads, its max, its sums
    for (int idx = threadIdx.x; idx < (h1 - h0) * D; idx += blockDim.x) {
      const int h = h0 + idx / D, t = idx % D;
      float mv[NP], lv[NP], ov[NP];
      merge_load<NP, D, NC>(o_part, ml, h, t, 0, na, mv, lv, ov);
      float m = -INFINITY;
#pragma unroll
      for (int c = 0; c < NP; ++c) m = fmaxf(m, mv[c]);
      float num = 0.f, den = 0.f;
      merge_weigh<NP>(mv, lv, ov, m, num, den);
      out[attention_out_row<QK, OHQ>(h) * D + t] = from_f<TO>(den > 0.f ? num / den : 0.f);   // all masked: 0, as SDPA
    }
  } else if (FUSEC_MERGE_ONE_PASS) {   // more than 32 partials: batches of NB loads in flight
    constexpr int NB = 16;   // 3 * 32 values in flight inside a loop spilled at the 128-register cap
    for (int idx = threadIdx.x; idx < (h1 - h0) * D; idx += blockDim.x) {
      const int h = h0 + idx / D, t = idx % D;
      float m = -INFINITY;
      for (int c0 = 0; c0 < na; c0 += NB) {
        float mv[NB];
#pragma unroll
        for (int c = 0; c < NB; ++c) mv[c] = c0 + c < na ? __ldcg(ml + (h * NC + c0 + c) * 2) : -INFINITY;
#pragma unroll
        for (int c = 0; c < NB; ++c) m = fmaxf(m, mv[c]);
      }
      float num = 0.f, den = 0.f;
      for (int c0 = 0; c0 < na; c0 += NB) {
        float mv[NB], lv[NB], ov[NB];
        merge_load<NB, D, NC>(o_part, ml, h, t, c0, na, mv, lv, ov);
        merge_weigh<NB>(mv, lv, ov, m, num, den);
      }
      out[attention_out_row<QK, OHQ>(h) * D + t] = from_f<TO>(den > 0.f ? num / den : 0.f);
    }
  } else {
    for (int idx = threadIdx.x; idx < (h1 - h0) * D; idx += blockDim.x) {
      const int h = h0 + idx / D, t = idx % D;
      float m = -INFINITY;
      for (int c = 0; c < na; ++c) m = fmaxf(m, __ldcg(ml + (h * NC + c) * 2));
      float num = 0.f, den = 0.f;
      for (int c = 0; c < na; ++c) {
        const float mc = __ldcg(ml + (h * NC + c) * 2);
        const float w = mc == -INFINITY ? 0.f : expf(mc - m);
        num += w * __ldcg(o_part + (h * NC + c) * D + t);
        den += w * __ldcg(ml + (h * NC + c) * 2 + 1);
      }
      out[attention_out_row<QK, OHQ>(h) * D + t] = from_f<TO>(den > 0.f ? num / den : 0.f);   // all masked: 0, as SDPA
    }
  }
}
