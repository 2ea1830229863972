// Helpers of the generated generic ops (fusec/cudagen): loads, dtype casts, warp reductions and
// the scalar math whose PyTorch semantics need more than one C operator. Emitted once, before
// the generated op functions, in kernels that have any.
// Portable: with GX_HOST defined (fusec/cuda/gen/host.py provides the shim) the same code
// compiles as single-thread host C++, which is how the CPU tests check the generated ops.
#ifndef GX_HOST
#define GX_LANE ((int)(threadIdx.x & 31))
#define GX_NLANES 32
#define GX_WARP ((int)(threadIdx.x >> 5))
// the CTA's threads as a compile-time constant where the kernel defines it (FUSEC_THREADS, checked
// by codegen), so that strided loops over a static size have a static trip count and unroll
#ifdef FUSEC_THREADS
#define GX_NTHREADS FUSEC_THREADS
#else
#define GX_NTHREADS ((int)blockDim.x)
#endif
#define GX_NWARPS (GX_NTHREADS >> 5)
#define GX_SYNC() __syncthreads()
template <typename T> __device__ __forceinline__ T gx_shfl_xor(T v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
// Reduce v over the CTA (every thread gets the result): a warp shuffle reduction, then each
// thread combines the warps' partials from shared memory. Every thread of the CTA must call it
// (two barriers; the first keeps a previous call's readers from seeing this call's partials).
template <typename T, typename F> __device__ __forceinline__ T gx_block_reduce(T v, F f) {
  __shared__ T gx_red[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) gx_red[threadIdx.x >> 5] = v;
  __syncthreads();
  T r = gx_red[0];
#pragma unroll
  for (int w = 1; w < GX_NWARPS; ++w) r = f(r, gx_red[w]);
  return r;
}
// v, through an empty asm the compiler cannot see through: a value computed before it is not
// contracted with arithmetic after it (a folded prologue's fp32 member outputs in registers)
__device__ __forceinline__ float gx_opaque(float v) { asm("" : "+f"(v)); return v; }
__device__ __forceinline__ float gx_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float gx_nan() { return __int_as_float(0x7fc00000); }
#endif

template <typename A, typename B> struct gx_same { static constexpr bool v = false; };
template <typename A> struct gx_same<A, A> { static constexpr bool v = true; };
template <typename T> struct gx_isflt {
  static constexpr bool v = gx_same<T, float>::v || gx_same<T, __half>::v || gx_same<T, __nv_bfloat16>::v;
};

// Loads: gx_ldg for weights, constants and inputs (read-only in the launch), gx_ldcg for
// anything another instruction of this launch may have written (L2, coherent).
template <typename T> __device__ __forceinline__ T gx_ldg(const T* p) { return __ldg(p); }
template <> __device__ __forceinline__ bool gx_ldg<bool>(const bool* p) {
  return __ldg(reinterpret_cast<const unsigned char*>(p)) != 0;
}
template <typename T> __device__ __forceinline__ T gx_ldcg(const T* p) { return __ldcg(p); }
template <> __device__ __forceinline__ bool gx_ldcg<bool>(const bool* p) {
  return __ldcg(reinterpret_cast<const unsigned char*>(p)) != 0;
}

// Value conversions with PyTorch's rules: floating types through fp32 (round to nearest even
// at the destination), floating to integer truncates, anything to bool is `!= 0`.
template <typename T> __device__ __forceinline__ float gx_f(T v) {
  if constexpr (gx_isflt<T>::v) return to_f(v); else return (float)v;
}
template <typename D, typename S> __device__ __forceinline__ D gx_cast(S v) {
  if constexpr (gx_same<D, S>::v) {
    return v;
  } else if constexpr (gx_same<D, bool>::v) {
    if constexpr (gx_isflt<S>::v) return to_f(v) != 0.f; else return v != 0;
  } else if constexpr (gx_isflt<D>::v) {
    return from_f<D>(gx_f(v));
  } else {
    if constexpr (gx_isflt<S>::v) return (D)to_f(v); else return (D)v;
  }
}

// NaN-propagating max / min (torch.maximum, amax); plain comparisons for integers.
template <typename T> __device__ __forceinline__ T gx_max(T a, T b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}
template <typename T> __device__ __forceinline__ T gx_min(T a, T b) {
  if (a != a) return a;
  if (b != b) return b;
  return a < b ? a : b;
}
struct GxSum { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; } };
struct GxProd { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a * b; } };
struct GxMax { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return gx_max(a, b); } };
struct GxMin { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return gx_min(a, b); } };
struct GxOr { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a | b; } };

// Reduce v over the lanes of a warp (every lane gets the result; one lane on the host).
template <typename T, typename F> __device__ __forceinline__ T gx_warp_reduce(T v, F f) {
#pragma unroll
  for (int o = GX_NLANES / 2; o > 0; o >>= 1) v = f(v, gx_shfl_xor(v, o));
  return v;
}
// Arg-reduce (value, index) over a warp: the best value (max if `largest`, NaN counts as the
// largest), ties to the smallest index (torch.argmax / max.dim).
template <typename T> __device__ __forceinline__ bool gx_better(T a, i64 ia, T b, i64 ib, bool largest) {
  const bool an = a != a, bn = b != b;
  if (an || bn) return an && (!bn || ia < ib);
  if (a == b) return ia < ib;
  return largest ? a > b : a < b;
}
template <typename T> __device__ __forceinline__ void gx_warp_argbest(T& v, i64& i, bool largest) {
#pragma unroll
  for (int o = GX_NLANES / 2; o > 0; o >>= 1) {
    const T ov = gx_shfl_xor(v, o);
    const i64 oi = gx_shfl_xor(i, o);
    if (gx_better(ov, oi, v, i, largest)) { v = ov; i = oi; }
  }
}

// Integer and floating division / remainder as PyTorch defines them.
__device__ __forceinline__ i64 gx_floordiv(i64 a, i64 b) {
  if (b == 0) return 0;
  i64 q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
__device__ __forceinline__ float gx_floordiv(float a, float b) {
  if (b == 0.f) return a / b;
  const float mod = fmodf(a, b);
  float div = (a - mod) / b;
  if ((mod != 0.f) && ((b < 0.f) != (mod < 0.f))) div -= 1.f;
  float fd;
  if (div != 0.f) {
    fd = floorf(div);
    if (div - fd > 0.5f) fd += 1.f;
  } else {
    fd = copysignf(0.f, a / b);
  }
  return fd;
}
__device__ __forceinline__ i64 gx_truncdiv(i64 a, i64 b) { return b == 0 ? 0 : a / b; }
__device__ __forceinline__ float gx_truncdiv(float a, float b) { return truncf(a / b); }
__device__ __forceinline__ i64 gx_remainder(i64 a, i64 b) {
  if (b == 0) return 0;
  i64 r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}
__device__ __forceinline__ float gx_remainder(float a, float b) {
  float r = fmodf(a, b);
  if (r != 0.f && ((b < 0.f) != (r < 0.f))) r += b;
  return r;
}
// torch.fmod: C's truncated remainder (the sign of the dividend)
__device__ __forceinline__ i64 gx_fmod(i64 a, i64 b) { return b == 0 ? 0 : a % b; }
__device__ __forceinline__ float gx_fmod(float a, float b) { return fmodf(a, b); }
__device__ __forceinline__ i64 gx_ipow(i64 b, i64 e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  i64 r = 1;
  while (e) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return r;
}
template <typename T> __device__ __forceinline__ T gx_sign(T x) { return (T)((T)0 < x) - (T)(x < (T)0); }
__device__ __forceinline__ float gx_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gx_silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float gx_gelu(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gx_gelu_tanh(float x) {
  const float k = 0.79788456080286535588f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + tanhf(k));
}
// As gx_warp_argbest, where index -1 marks a lane without a candidate.
template <typename T> __device__ __forceinline__ void gx_warp_argbest_valid(T& v, i64& i, bool largest) {
#pragma unroll
  for (int o = GX_NLANES / 2; o > 0; o >>= 1) {
    const T ov = gx_shfl_xor(v, o);
    const i64 oi = gx_shfl_xor(i, o);
    if (oi >= 0 && (i < 0 || gx_better(ov, oi, v, i, largest))) { v = ov; i = oi; }
  }
}
