// Device helpers shared by every instruction template.
// Loads: weights and constants with the read-only path (__ldg); activations, KV cache and
// position counters with __ldcg (L2, coherent with other SMs' stores in this launch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
// round to T's precision, keep computing in fp32 (PyTorch rounds at each op's output)
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Ask the copy engine to stream [p, p + bytes) into L2 (sm_90 bulk prefetch; no registers,
// no completion to wait for). Used to issue an instruction's weight loads before its waits.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned long long bytes) {
  const char* c = static_cast<const char*>(p);
  while (bytes >= 16) {
    const unsigned n = bytes > (1ull << 20) ? (1u << 20) : (unsigned)(bytes & ~15ull);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c), "r"(n) : "memory");
    c += n;
    bytes -= n;
  }
}

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

// One row of a matvec: dot(w[0:K], xs[0:K]) by one warp; 16-byte weight loads when K allows.
template <typename TW, int K>
__device__ __forceinline__ float row_dot(const TW* __restrict__ w, const float* __restrict__ xs, int lane) {
  constexpr int V = 16 / sizeof(TW);
  float acc = 0.f;
  if constexpr (K % V == 0) {
#pragma unroll 4
    for (int k = lane * V; k < K; k += 32 * V) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(w + k));
      const TW* e = reinterpret_cast<const TW*>(&raw);
#pragma unroll
      for (int j = 0; j < V; ++j) acc += to_f(e[j]) * xs[k + j];
    }
  } else {
    for (int k = lane; k < K; k += 32) acc += to_f(__ldg(w + k)) * xs[k];
  }
  return warp_sum(acc);
}

// RMSNorm of x (HF LlamaRMSNorm): ns[i] = rnd<TN>(w[i] * rnd<TX>(x[i] * rsqrt(mean(x^2) + eps))).
template <typename TX, typename TW, typename TN, int H>
__device__ __forceinline__ void rms_prologue(const TX* x, const TW* w, float eps, float* ns, float* red) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = to_f(__ldcg(x + i));
    ns[i] = v;
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss, red) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) ns[i] = rnd<TN>(to_f(__ldg(w + i)) * rnd<TX>(ns[i] * r));
  __syncthreads();
}
