// tidestore GPU AdamW over compact moments (optimizer.states = bf16 | int8), compiled
// appended to adamw.cu (it uses AdamConsts, load_grad and the 16-bit conversions there)
// with the same options: every rounding explicit (__fmaf_rn / __fmul_rn / __fsqrt_rn /
// __fdiv_rn, --fmad=false), the operation order of the CPU kernel
// (optimizer/src/cpu/scalar.rs `adam`), and the quantizer of optimizer/src/quant.rs bit
// for bit: integer absmax of the magnitude bits (NaN if any element is inf/NaN, at least
// 2^-126 unless 0), one correctly rounded reciprocal per block, x * r, the code = the
// number of midpoints strictly below it by the same 8-step binary search.
//
// adamw_m16_<g>_<o>_<mode>: bf16 M and V (u16 bits), grid-stride over elements.
// adamw_q8_<g>_<o>_<mode>:  int8 M and V: codes (one byte per element) and one fp32
//   absmax per 256 elements. Launched with exactly 256 threads per block: one thread
//   block per quantization block (grid-stride over blocks). `maps` points to 1024
//   floats: signed values, signed midpoints, unsigned values, unsigned midpoints
//   (quant.rs `DynamicMap::values` / `midpoints`, 256 each, the last midpoint +inf).
// Aliasing as in adamw.cu: g and out may be the same pointer (read first, same thread).

__device__ __forceinline__ void adam_step(
    float& p, float& m, float& v, float g, bool l2, AdamConsts c) {
    float gi = __fmul_rn(g, c.grad_scale);
    if (l2) {
        gi = __fmaf_rn(c.wd_l2, p, gi);
    }
    m = __fmaf_rn(c.beta1, m, __fmul_rn(c.one_minus_beta1, gi));
    v = __fmaf_rn(c.beta2, v, __fmul_rn(__fmul_rn(c.one_minus_beta2, gi), gi));
    float d = __fmaf_rn(__fsqrt_rn(v), c.inv_sqrt_bc2, c.eps);
    if (!l2) {
        p = __fmaf_rn(c.neg_lr_wd, p, p);
    }
    p = __fmaf_rn(c.neg_step, __fdiv_rn(m, d), p);
}

template <int OK>
__device__ __forceinline__ void store_out(u16* out, u64 i, float p) {
    if (OK == 1) {
        out[i] = f32_to_f16_bits(p);
    } else if (OK == 2) {
        out[i] = f32_to_bf16_bits(p);
    }
}

template <int GK, int OK, bool L2>
__device__ __forceinline__ void adamw_m16_body(
    float* __restrict__ p, u16* __restrict__ m, u16* __restrict__ v,
    const void* g, u16* out, u64 n, AdamConsts c) {
    u64 stride = (u64)blockDim.x * (u64)gridDim.x;
    for (u64 i = (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x; i < n; i += stride) {
        float gi = load_grad<GK>(g, i);
        float pi = p[i];
        float mi = __uint_as_float(((u32)m[i]) << 16);
        float vi = __uint_as_float(((u32)v[i]) << 16);
        adam_step(pi, mi, vi, gi, L2, c);
        p[i] = pi;
        m[i] = f32_to_bf16_bits(mi);
        v[i] = f32_to_bf16_bits(vi);
        store_out<OK>(out, i, pi);
    }
}

__device__ __forceinline__ float q8_absmax_of_bits(u32 bits) {
    if (bits >= 0x7f800000u) {
        return __uint_as_float(0x7fc00000u);
    }
    if (bits == 0u) {
        return 0.0f;
    }
    return __uint_as_float(bits > 0x00800000u ? bits : 0x00800000u);
}

__device__ __forceinline__ float q8_inverse(float absmax) {
    return absmax == 0.0f ? 0.0f : __fdiv_rn(1.0f, absmax);
}

__device__ __forceinline__ u8 q8_code(const float* mid, float x) {
    u32 lo = 0u;
#pragma unroll
    for (u32 s = 128u; s > 0u; s >>= 1) {
        if (x > mid[lo + s - 1u]) {
            lo += s;
        }
    }
    return (u8)lo;
}

template <int GK, int OK, bool L2>
__device__ __forceinline__ void adamw_q8_body(
    float* __restrict__ p, u8* __restrict__ mc, float* __restrict__ ma,
    u8* __restrict__ vc, float* __restrict__ va, const void* g, u16* out, u64 n,
    const float* __restrict__ maps, AdamConsts c) {
    __shared__ float smap[1024];
    __shared__ u32 red[2][8];
    for (u32 k = threadIdx.x; k < 1024u; k += blockDim.x) {
        smap[k] = maps[k];
    }
    __syncthreads();
    u64 blocks = (n + 255u) / 256u;
    u32 warp = threadIdx.x / 32u;
    u32 lane = threadIdx.x % 32u;
    for (u64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        u64 i = b * 256u + threadIdx.x;
        bool live = i < n;
        float am = ma[b];
        float av = va[b];
        float mi = 0.0f;
        float vi = 0.0f;
        u32 mbits = 0u;
        u32 vbits = 0u;
        if (live) {
            float gi = load_grad<GK>(g, i);
            float pi = p[i];
            mi = __fmul_rn(smap[mc[i]], am);
            vi = __fmul_rn(smap[512u + vc[i]], av);
            adam_step(pi, mi, vi, gi, L2, c);
            p[i] = pi;
            store_out<OK>(out, i, pi);
            mbits = __float_as_uint(mi) & 0x7fffffffu;
            vbits = __float_as_uint(vi) & 0x7fffffffu;
        }
        // The block's integer maxima: within each warp, then over the 8 warps.
        u32 wm = __reduce_max_sync(0xffffffffu, mbits);
        u32 wv = __reduce_max_sync(0xffffffffu, vbits);
        if (lane == 0u) {
            red[0][warp] = wm;
            red[1][warp] = wv;
        }
        __syncthreads();
        u32 bm = 0u;
        u32 bv = 0u;
#pragma unroll
        for (u32 w = 0u; w < 8u; ++w) {
            bm = max(bm, red[0][w]);
            bv = max(bv, red[1][w]);
        }
        // Every thread has read `red` and this block's old absmax before either is
        // written again.
        __syncthreads();
        float nam = q8_absmax_of_bits(bm);
        float nav = q8_absmax_of_bits(bv);
        if (live) {
            mc[i] = q8_code(smap + 256, __fmul_rn(mi, q8_inverse(nam)));
            vc[i] = q8_code(smap + 768, __fmul_rn(vi, q8_inverse(nav)));
        }
        if (threadIdx.x == 0u) {
            ma[b] = nam;
            va[b] = nav;
        }
    }
}

#define ADAMW_M16_KERNEL(NAME, GK, OK, L2)                                               \
    extern "C" __global__ void NAME(float* p, u16* m, u16* v, const void* g, u16* out,   \
                                    u64 n, AdamConsts c) {                               \
        adamw_m16_body<GK, OK, L2>(p, m, v, g, out, n, c);                               \
    }

#define ADAMW_Q8_KERNEL(NAME, GK, OK, L2)                                                \
    extern "C" __global__ void __launch_bounds__(256) NAME(                              \
        float* p, u8* mc, float* ma, u8* vc, float* va, const void* g, u16* out, u64 n,  \
        const float* maps, AdamConsts c) {                                               \
        adamw_q8_body<GK, OK, L2>(p, mc, ma, vc, va, g, out, n, maps, c);                \
    }

#define COMPACT_KERNELS(G, GK, O, OK)                                                    \
    ADAMW_M16_KERNEL(adamw_m16_##G##_##O##_adamw, GK, OK, false)                         \
    ADAMW_M16_KERNEL(adamw_m16_##G##_##O##_l2, GK, OK, true)                             \
    ADAMW_Q8_KERNEL(adamw_q8_##G##_##O##_adamw, GK, OK, false)                           \
    ADAMW_Q8_KERNEL(adamw_q8_##G##_##O##_l2, GK, OK, true)

COMPACT_KERNELS(f32, 0, none, 0)
COMPACT_KERNELS(f32, 0, f16, 1)
COMPACT_KERNELS(f32, 0, bf16, 2)
COMPACT_KERNELS(f16, 1, none, 0)
COMPACT_KERNELS(f16, 1, f16, 1)
COMPACT_KERNELS(f16, 1, bf16, 2)
COMPACT_KERNELS(bf16, 2, none, 0)
COMPACT_KERNELS(bf16, 2, f16, 1)
COMPACT_KERNELS(bf16, 2, bf16, 2)
