// Device helpers shared by every instruction template.
// Loads: weights and constants with the read-only path (__ldg); activations, KV cache and
// position counters with __ldcg (L2, coherent with other SMs' stores in this launch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
// A run-time length (the KV cache's rows in a length-polymorphic kernel) from its slot of the
// pointer table, which holds the integer instead of a pointer (fusec.cuda.codegen.Buffers.length)
#define FUSEC_LEN(b) ((int)(long long)(b))

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
// round to T's precision, keep computing in fp32 (PyTorch rounds at each op's output)
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

// Status the host reads without a sync: fusec_status points to page-locked host memory mapped
// into the device (the host sets the pointer once at load): FUSEC_ST_HEAD int64 header words
// (FUSEC_ST_*: something was recorded (set last), index fault, its code, value and bound,
// watchdog fired), then the watchdog's records, FUSEC_WD_REC ints per SM (as in wd); abi.cuh.j2.
// Only the slow paths write it, out of line (no code in the hot instruction stream): the
// record, __threadfence_system() (the record reaches the host before its flags), the flags.
// Nothing polls it: the watchdog's abort flag stays in device memory.
__device__ long long* fusec_status;
__device__ __noinline__ void fusec_report_fault(long long code, long long v, long long bound) {
  volatile long long* s = fusec_status;
  s[FUSEC_ST_CODE] = code;
  s[FUSEC_ST_VALUE] = v;
  s[FUSEC_ST_BOUND] = bound;
  __threadfence_system();
  s[FUSEC_ST_FAULT] = 1;
  s[FUSEC_ST_ANY] = 1;
}
// one stuck wait's record (SM, queue index, op, counter, value, target, instruction) in SM's slot
__device__ __noinline__ void fusec_report_wait(int sm, int q, int op, int c, int v, int target, int id) {
  volatile int* h = reinterpret_cast<volatile int*>(fusec_status + FUSEC_ST_HEAD) + FUSEC_WD_REC * sm;
  h[FUSEC_WD_SM] = sm; h[FUSEC_WD_QUEUE_INDEX] = q; h[FUSEC_WD_OP] = op; h[FUSEC_WD_COUNTER] = c;
  h[FUSEC_WD_VALUE] = v; h[FUSEC_WD_TARGET] = target; h[FUSEC_WD_INSTRUCTION] = id;
  __threadfence_system();
  h[FUSEC_WD_CLAIMED] = FUSEC_CLAIM_RECORD;
  volatile long long* s = fusec_status;
  s[FUSEC_ST_WATCHDOG] = 1;
  s[FUSEC_ST_ANY] = 1;
}

// Run-time index faults: the first out-of-range token id or position is reported and its access
// skipped. fusec_fault points to a device int64 word (set once, by atomicCAS: the first fault
// wins; the host clears it); the winner writes code, value and bound to the host-mapped status,
// and the host raises IndexFaultError at its next call.
// code: which index, FUSEC_FAULT_* (abi.cuh.j2; fusec.abi.Fault).
__device__ long long* fusec_fault;
__device__ __forceinline__ bool index_ok(i64 v, i64 bound, int code) {
  if (v >= 0 && v < bound) return true;
  if (atomicCAS(reinterpret_cast<unsigned long long*>(fusec_fault), 0ull, 1ull) == 0ull)
    fusec_report_fault(code, v, bound);
  return false;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// atomicInc (wraps to 0 after `limit`) with acquire-release semantics at GPU scope
__device__ __forceinline__ unsigned atom_inc_acq_rel(unsigned* p, unsigned limit) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(limit) : "memory");
  return old;
}
// torch.argmax's order of (value, index) candidates: NaN above every number, then larger values,
// then the smaller index (rms_lm_head's and argmax_rows' merges)
__device__ __forceinline__ bool argmax_better(float v, int r, float b, int br) {
  if (v != v) return b == b || r < br;
  return b == b && (v > b || (v == b && r < br));
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Profiling marks: FUSEC_MARK(k) records when thread 0 passed point k of an instruction template
// (k < FUSEC_MARKS); the profiling build writes them after the instruction's (SM, fetched,
// waits satisfied, done) record. A no-op in other builds.
#ifdef FUSEC_MARKS
__shared__ unsigned long long fusec_marks[FUSEC_MARKS];
#define FUSEC_MARK(k) do { static_assert((k) < FUSEC_MARKS, "FUSEC_MARK slot out of range"); \
                          if (threadIdx.x == 0) fusec_marks[k] = globaltimer(); } while (0)
// the same, once the float v is in thread 0's registers (a load's arrival, not its issue)
#define FUSEC_MARK_AFTER(k, v) do { static_assert((k) < FUSEC_MARKS, "FUSEC_MARK slot out of range"); \
                                    if (threadIdx.x == 0 && !((v) < 0.f)) fusec_marks[k] = globaltimer(); } while (0)
#else
#define FUSEC_MARK(k) do { } while (0)
#define FUSEC_MARK_AFTER(k, v) do { } while (0)
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the CTA; `red` holds NW + 1 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const float r = red[32];
  __syncthreads();
  return r;
}

// 16-byte load of weights that are read once per step: read-only path, no L1 allocation.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 { %0, %1, %2, %3 }, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// V consecutive elements of a shared-memory vector as floats; 16-byte loads when they fit.
template <typename TS, int V>
__device__ __forceinline__ void lds_vec(const TS* p, float (&f)[V]) {
  if constexpr ((V * sizeof(TS)) % 16 == 0) {
    constexpr int E = 16 / sizeof(TS);
#pragma unroll
    for (int c = 0; c < V / E; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
      const TS* e = reinterpret_cast<const TS*>(&raw);
#pragma unroll
      for (int j = 0; j < E; ++j) f[c * E + j] = to_f(e[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = to_f(p[j]);
  }
}

// Every kind's device function is out of line: the cases of a kind (one per layer) call one copy
// of its code instead of inlining one each: smaller kernel text for the instruction cache, and a
// far shorter NVRTC compile (on a 2-core CPU: Llama-3.2-1B 11.2 -> 1.4 s, Qwen3-0.6B 26.6 ->
// 2.6 s; the split-KV kind inlined once per layer was most of it). Inlined, the kinds other than
// the per-layer matvecs made the Llama-3.2-1B step 31-52 us longer on the H200 (2026-12-02; the
// knob that did it, FUSEC_INLINE_OTHER_KINDS, is in experiments/removed-knobs.patch).
#define FUSEC_KIND_FN __noinline__

// Tuning knobs (FUSEC_LOADS_IN_FLIGHT, FUSEC_ATTN_SINGLE, ...): #defined at the top of the kernel by
// codegen (fusec.cuda.knobs holds all of them, their defaults and meaning).

// Batch shape of a matvec over R rows of length K: B loads of 16 bytes per row and lane in flight.
// A row is NK full steps of a warp (32 x 16 bytes) and TAIL 16-byte chunks past them (K = 4544:
// 17 steps and 24 chunks), one each for lanes [0, TAIL). Rows of at most FUSEC_ONE_BATCH_STEPS
// steps in all (NK * R) take them in one batch (a batch of FUSEC_LOADS_IN_FLIGHT / R and the rest
// would be two dependent round trips), longer ones in batches of FUSEC_LOADS_IN_FLIGHT / R.
template <typename TW, int K, int R>
struct MatvecBatch {
  static constexpr int V = 16 / sizeof(TW), STEP = 32 * V;
  static constexpr bool VEC = K % V == 0;         // the batched path runs
  static constexpr int NK = K / STEP, TAIL = (K % STEP) / V;
  static constexpr int B0 = NK > 0 && NK * R <= FUSEC_ONE_BATCH_STEPS ? NK
                          : FUSEC_LOADS_IN_FLIGHT / R > 0 ? FUSEC_LOADS_IN_FLIGHT / R : 1;
  static constexpr int B = NK < B0 ? (NK > 0 ? NK : 1) : B0;
  static constexpr int NB = NK / B;
};

// The FMAs of one batch: acc[r] += sum over b, j of raw[r][b][j] * xs[k + b * STEP + j].
template <typename TW, typename TS, int R, int B>
__device__ __forceinline__ void fma_batch(const uint4 (&raw)[R][B], const TS* __restrict__ xs, int k,
                                          float (&acc)[R]) {
  constexpr int V = 16 / sizeof(TW), STEP = 32 * V;
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float xv[V];
    lds_vec<TS, V>(xs + k + b * STEP, xv);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const TW* e = reinterpret_cast<const TW*>(&raw[r][b]);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[r] = fmaf(to_f(e[j]), xv[j], acc[r]);
    }
  }
}

// B batches of R rows: issue all R*B 16-byte weight loads, then the FMAs (memory-level
// parallelism: the loads of a batch are in flight together).
template <typename TW, typename TS, int R, int B>
__device__ __forceinline__ void dot_batch(const TW* const (&w)[R], const TS* __restrict__ xs, int k,
                                          float (&acc)[R]) {
  constexpr int STEP = 32 * (16 / sizeof(TW));
  uint4 raw[R][B];
#pragma unroll
  for (int b = 0; b < B; ++b)
#pragma unroll
    for (int r = 0; r < R; ++r) raw[r][b] = ld_stream(w[r] + k + b * STEP);
  fma_batch<TW, TS, R, B>(raw, xs, k, acc);
}

// R rows of a matvec by one warp: out[r] = dot(w[r][0:K], xs[0:K]) (fp32 accumulation), every
// lane gets the sums. xs is the input vector in shared memory in its own dtype TS (exact);
// weights stream with 16-byte loads, FUSEC_LOADS_IN_FLIGHT per lane in flight, when K is a
// multiple of 16 bytes (scalar loads otherwise): batches of B full warp steps, then the steps
// left and, where K is not a multiple of a warp's step (32 x 16 bytes: Falcon-7B's 4544,
// Qwen2.5-0.5B's 896 in bf16), the lane chunks past the last full step, loaded together. Each
// lane sums its chunks in the order of a plain strided loop (the code before this path took one
// or two loads per lane in flight for such K: 2.4-3.1 TB/s on Falcon-7B's 4544-wide rows on the
// H200, docs/performance.md). The chunks past the full steps are loaded with the steps left,
// not before the batches: held through them, they spilled at the 128-register cap (fp32, 4544).
template <typename TW, typename TS, int K, int R>
__device__ __forceinline__ void dot_rows(const TW* const (&w)[R], const TS* __restrict__ xs, int lane,
                                         float (&out)[R]) {
  using M = MatvecBatch<TW, K, R>;
  constexpr int V = M::V, STEP = M::STEP;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  if constexpr (M::VEC) {
    constexpr int B = M::B, NB = M::NB, NR = M::NK - NB * B;   // NR full steps after the batches
#pragma unroll 1
    for (int i = 0; i < NB; ++i) dot_batch<TW, TS, R, B>(w, xs, i * B * STEP + lane * V, acc);
    if constexpr (NR > 0 || M::TAIL > 0) {
      uint4 raw[R][NR + 1];                     // the steps left, then the lane's chunk past them
#pragma unroll
      for (int b = 0; b < NR; ++b)
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r][b] = ld_stream(w[r] + (NB * B + b) * STEP + lane * V);
      const int kt = M::NK * STEP + lane * V;
      if constexpr (M::TAIL > 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r][NR] = lane < M::TAIL ? ld_stream(w[r] + kt) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int b = 0; b < NR + (M::TAIL > 0 ? 1 : 0); ++b) {
        if (b == NR && lane >= M::TAIL) break;   // past the row (a lane without a chunk there)
        uint4 one[R][1];
#pragma unroll
        for (int r = 0; r < R; ++r) one[r][0] = raw[r][b];
        fma_batch<TW, TS, R, 1>(one, xs, b < NR ? (NB * B + b) * STEP + lane * V : kt, acc);
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
      for (int k = lane; k < K; k += 32) acc[r] = fmaf(to_f(__ldg(w[r] + k)), to_f(xs[k]), acc[r]);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = warp_sum(acc[r]);
}

// The gate activation of a GLU MLP (rms_gate_up_silu): ACT 0 SiLU (SwiGLU,
// Llama), 1 GELU tanh approximation, 2 exact GELU (GeGLU, Gemma); the GELUs rounded to TO, as
// PyTorch's separate activation op rounds.
template <int ACT, typename TO>
__device__ __forceinline__ float gate_act(float g) {
  if constexpr (ACT == 1) {
    const float k = 0.7978845608028654f;   // sqrt(2/pi)
    return rnd<TO>(0.5f * g * (1.f + tanhf(k * (g + 0.044715f * g * g * g))));
  } else if constexpr (ACT == 2) {
    return rnd<TO>(0.5f * g * (1.f + erff(g * 0.7071067811865476f)));
  } else {
    return g / (1.f + expf(-g));
  }
}

// The activation epilogue of the matvec kinds (fusec/instructions/activation.py, ACTS): d the
// output element's fp32 result (dot plus bias), rounded to TO as the linear's output rounds, then
// ACT 1 the GELU tanh approximation, 2 exact GELU (gate_act: rounded to TO as PyTorch's op),
// 3 HF's NewGELUActivation (gelu_new: 0.5 * y * (1 + tanh(sqrt(2 / pi) * (y + 0.044715 * y^3))),
// each of its eight ops rounded to TO, pow(y, 3) as PyTorch's pow kernel computes it in a 16-bit
// dtype: y * y * y rounded after each product). ACT 0: d unchanged (the caller rounds it once).
template <int ACT, typename TO>
__device__ __forceinline__ float act_epilogue(float d) {
  if constexpr (ACT == 0) {
    return d;
  } else if constexpr (ACT == 3) {
    const float y = rnd<TO>(d), h = rnd<TO>(y * 0.5f);
    const float c = rnd<TO>(rnd<TO>(rnd<TO>(y * y) * y) * 0.044715f);
    const float th = rnd<TO>(tanhf(rnd<TO>(rnd<TO>(y + c) * 0.7978845608028654f)));
    return h * rnd<TO>(th + 1.f);
  } else {
    static_assert(ACT == 1 || ACT == 2, "act_epilogue: ACT 0-3");
    return gate_act<ACT, TO>(rnd<TO>(d));
  }
}

// Row r of a GLU MLP's intermediate vector by one warp, every lane gets it:
// act(rnd(Wg[r] . n)) * rnd(Wu[r] . n), unrounded (callers round to TO, as PyTorch does).
template <typename TW, typename TN, typename TO, int H, int ACT>
__device__ __forceinline__ float glu_row(const TW* __restrict__ wg, const TW* __restrict__ wu, const TN* n, int r,
                                         int lane) {
  const TW* const w2[2] = {wg + (size_t)r * H, wu + (size_t)r * H};
  float gu[2];
  dot_rows<TW, TN, H, 2>(w2, n, lane, gu);
  return gate_act<ACT, TO>(rnd<TO>(gu[0])) * rnd<TO>(gu[1]);
}

// One row of a matvec: dot(w[0:K], xs[0:K]) by one warp (see dot_rows).
template <typename TW, typename TS, int K>
__device__ __forceinline__ float row_dot(const TW* __restrict__ w, const TS* __restrict__ xs, int lane) {
  const TW* const ws[1] = {w};
  float out[1];
  dot_rows<TW, TS, K, 1>(ws, xs, lane, out);
  return out[0];
}

// Stage x[0:K] into shared memory in its own dtype (16-byte copies when K allows).
// FUSEC_STAGE_BATCH 1: a thread's PT <= 8 copies are all loaded before any is stored (one L2
// round trip; the loop's loads each wait for the one before: 2 per thread for K = 8192 bf16);
// 2: also more than 8, in rounds of 8 (a batch's B inputs).
template <typename TX, int K>
__device__ __forceinline__ void stage_vec(const TX* __restrict__ x, TX* xs) {
  constexpr int E = 16 / sizeof(TX), PT = (K / E + FUSEC_THREADS - 1) / FUSEC_THREADS;
  if constexpr (K % E == 0 && FUSEC_STAGE_BATCH && PT <= 8) {
    uint4 v[PT];
#pragma unroll
    for (int k = 0; k < PT; ++k) {
      const int i = threadIdx.x + k * FUSEC_THREADS;
      v[k] = i < K / E ? __ldcg(reinterpret_cast<const uint4*>(x) + i) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int k = 0; k < PT; ++k) {
      const int i = threadIdx.x + k * FUSEC_THREADS;
      if (i < K / E) reinterpret_cast<uint4*>(xs)[i] = v[k];
    }
  } else if constexpr (K % E == 0 && FUSEC_STAGE_BATCH > 1) {
    // PT > 8 (a batch's inputs: B = 8 x 8192 bf16 is 16 copies per thread): rounds of 8 copies,
    // each round loaded before any of it is stored (the loop below waits for each load in
    // turn: 16 dependent L2 round trips; the B = 8 down projection's staging 3.9 -> 1.7 us, H200)
    constexpr int R = 8;
#pragma unroll 1
    for (int k0 = 0; k0 < PT; k0 += R) {
      uint4 v[R];
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const int i = threadIdx.x + (k0 + k) * FUSEC_THREADS;
        v[k] = i < K / E ? __ldcg(reinterpret_cast<const uint4*>(x) + i) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const int i = threadIdx.x + (k0 + k) * FUSEC_THREADS;
        if (i < K / E) reinterpret_cast<uint4*>(xs)[i] = v[k];
      }
    }
  } else if constexpr (K % E == 0) {
    for (int i = threadIdx.x; i < K / E; i += blockDim.x)
      reinterpret_cast<uint4*>(xs)[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
  } else {
    for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = __ldcg(x + i);
  }
  __syncthreads();
}

// RMSNorm of x (HF LlamaRMSNorm) into shared memory in the norm's output dtype TN (exact):
// ns[i] = rnd<TN>(w[i] * rnd<TX>(x[i] * rsqrt(mean(x^2) + eps))); with WF32 (Gemma, w = 1 + weight)
// the weight multiplies in fp32 before the one rounding: ns[i] = rnd<TN>(x[i] * rsqrt(...) * w[i]).
// Each thread's x and w elements are loaded once, together (one memory round trip), and kept
// in registers: with FUSEC_NORM_VEC (default 1), when the H / (16 B) chunks fit the CTA and w has
// x's dtype, one 16-byte chunk of each per thread; else up to 8 strided elements per thread.
// Beyond 8, a loop that loads x again to normalize (the same sums as the strided path).
template <typename TX, typename TW, typename TN, int H, bool WF32 = false>
__device__ __forceinline__ void rms_prologue(const TX* x, const TW* w, float eps, TN* ns, float* red) {
  constexpr int PER = (H + FUSEC_THREADS - 1) / FUSEC_THREADS;
  constexpr int E = 16 / sizeof(TX);
  if constexpr (FUSEC_NORM_VEC && H % E == 0 && H / E <= FUSEC_THREADS && sizeof(TW) == sizeof(TX)) {
    // FUSEC_NORM_VEC: one 16-byte chunk of x and of w per thread (as stage_vec loads x), kept
    // packed in registers until the normalization
    const bool on = threadIdx.x < H / E;
    uint4 xr = make_uint4(0u, 0u, 0u, 0u), wr = xr;
    if (on) {
      xr = __ldcg(reinterpret_cast<const uint4*>(x) + threadIdx.x);
      wr = __ldg(reinterpret_cast<const uint4*>(w) + threadIdx.x);
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const float v = to_f(reinterpret_cast<const TX*>(&xr)[j]);
      ss += v * v;
    }
    FUSEC_MARK_AFTER(5, ss);   // thread 0's x loaded
    const float r = rsqrtf(block_sum(ss, red) / H + eps);
    if (on) {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float xv = to_f(reinterpret_cast<const TX*>(&xr)[j]), wv = to_f(reinterpret_cast<const TW*>(&wr)[j]);
        ns[threadIdx.x * E + j] = from_f<TN>(WF32 ? xv * r * wv : wv * rnd<TX>(xv * r));
      }
    }
  } else if constexpr (PER <= 8) {
    float xv[PER], wv[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = threadIdx.x + k * FUSEC_THREADS;
      xv[k] = i < H ? to_f(__ldcg(x + i)) : 0.f;
      wv[k] = i < H ? to_f(__ldg(w + i)) : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < PER; ++k) ss += xv[k] * xv[k];
    FUSEC_MARK_AFTER(5, ss);   // thread 0's x loaded
    const float r = rsqrtf(block_sum(ss, red) / H + eps);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = threadIdx.x + k * FUSEC_THREADS;
      if (i < H) ns[i] = from_f<TN>(WF32 ? xv[k] * r * wv[k] : wv[k] * rnd<TX>(xv[k] * r));
    }
  } else {
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
      const float v = to_f(__ldcg(x + i));
      ss += v * v;
    }
    FUSEC_MARK_AFTER(5, ss);   // thread 0's x loaded
    const float r = rsqrtf(block_sum(ss, red) / H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
      const float xr = to_f(__ldcg(x + i)) * r, wi = to_f(__ldg(w + i));
      ns[i] = from_f<TN>(WF32 ? xr * wi : wi * rnd<TX>(xr));
    }
  }
  __syncthreads();
}
