// tidestore GPU AdamW: the same f32 arithmetic, in the same order, as the CPU kernel
// (optimizer/src/params.rs, `Consts`; optimizer/src/cpu/scalar.rs, `adam`), so a group
// updated on the GPU gives the bits the CPU would have given.
//
// Every rounding step is explicit: __fmaf_rn / __fmul_rn / __fsqrt_rn / __fdiv_rn, and
// the program is compiled with --fmad=false so nothing else is contracted. 16-bit
// conversions are integer code matching the `half` crate bit for bit (round to nearest
// even, NaN keeps its payload with the quiet bit set, subnormals exact, overflow to inf).
//
// NaN policy (the optimizer crate's doc): every NaN result of a step (p, m, v) is stored as
// the canonical NaN 0x7FFFFFFF, selected explicitly here as the CPU kernels do, so the
// bits agree whatever NaN arithmetic the hardware produces; the 16-bit output is converted
// from that value.
//
// One kernel per (gradient dtype, output dtype, L2 mode): adamw_<g>_<o>_<mode>, with
// g in {f32, f16, bf16}, o in {none, f16, bf16}, mode in {adamw, l2}. Grid-stride loop
// over n elements; every pointer is to n elements of its dtype.
//
// Aliasing: p, m and v are __restrict__ (they overlap nothing). g and out are not: they
// may be the same pointer (in-place step: the 16-bit gradient is read from the bytes the
// new 16-bit parameters are written to, g's dtype then equal to out's). That is safe
// because element i's gradient is read, and its output written, by the same thread, the
// read first; no thread touches another's element. Otherwise g and out do not overlap.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct AdamConsts {
    float grad_scale;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float wd_l2;
    float neg_lr_wd;
    float neg_step;
    float inv_sqrt_bc2;
    float eps;
};

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1fu;
    u32 man = (u32)h & 0x3ffu;
    u32 bits;
    if (exp == 0x1fu) {
        // inf, or NaN with its payload shifted up and the quiet bit set
        bits = sign | 0x7f800000u | (man != 0u ? 0x00400000u : 0u) | (man << 13);
    } else if (exp == 0u) {
        if (man == 0u) {
            bits = sign;
        } else {
            // subnormal half: normalise (the `half` crate's fallback, bit for bit)
            u32 e = (u32)__clz(man) - 22u;
            bits = sign | ((127u - 15u - e) << 23) | ((man << (14u + e)) & 0x7fffffu);
        }
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = x & 0x80000000u;
    u32 exp = x & 0x7f800000u;
    u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        u32 nan_bit = (man == 0u) ? 0u : 0x0200u;
        return (u16)((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }
    u32 half_sign = sign >> 16;
    int unbiased_exp = (int)(exp >> 23) - 127;
    int half_exp = unbiased_exp + 15;
    if (half_exp >= 0x1f) {
        return (u16)(half_sign | 0x7c00u);
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return (u16)half_sign;
        }
        u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) {
            half_man += 1u;
        }
        return (u16)(half_sign | half_man);
    }
    u32 half_exp_bits = ((u32)half_exp) << 10;
    u32 half_man = man >> 13;
    u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
        return (u16)((half_sign | half_exp_bits | half_man) + 1u);
    }
    return (u16)(half_sign | half_exp_bits | half_man);
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) {
        return (u16)((x >> 16) + 1u);
    }
    return (u16)(x >> 16);
}

// GK: 0 f32, 1 f16, 2 bf16. OK: 0 none, 1 f16, 2 bf16.
template <int GK>
__device__ __forceinline__ float load_grad(const void* g, u64 i) {
    if (GK == 0) {
        return ((const float*)g)[i];
    } else if (GK == 1) {
        return f16_bits_to_f32(((const u16*)g)[i]);
    } else {
        return __uint_as_float(((u32)((const u16*)g)[i]) << 16);
    }
}

__device__ __forceinline__ float canon_nan(float x) {
    return (x != x) ? __uint_as_float(0x7fffffffu) : x;
}

template <int GK, int OK, bool L2>
__device__ __forceinline__ void adamw_body(
    float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
    const void* g, u16* out, u64 n, AdamConsts c) {
    u64 stride = (u64)blockDim.x * (u64)gridDim.x;
    for (u64 i = (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x; i < n; i += stride) {
        // Read before out[i] is written below: g and out may be the same pointer.
        float gi = __fmul_rn(load_grad<GK>(g, i), c.grad_scale);
        float pi = p[i];
        if (L2) {
            gi = __fmaf_rn(c.wd_l2, pi, gi);
        }
        float mi = __fmaf_rn(c.beta1, m[i], __fmul_rn(c.one_minus_beta1, gi));
        float vi = __fmaf_rn(c.beta2, v[i], __fmul_rn(__fmul_rn(c.one_minus_beta2, gi), gi));
        float d = __fmaf_rn(__fsqrt_rn(vi), c.inv_sqrt_bc2, c.eps);
        if (!L2) {
            pi = __fmaf_rn(c.neg_lr_wd, pi, pi);
        }
        pi = canon_nan(__fmaf_rn(c.neg_step, __fdiv_rn(mi, d), pi));
        mi = canon_nan(mi);
        vi = canon_nan(vi);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (OK == 1) {
            out[i] = f32_to_f16_bits(pi);
        } else if (OK == 2) {
            out[i] = f32_to_bf16_bits(pi);
        }
    }
}

#define ADAMW_KERNEL(NAME, GK, OK, L2)                                                   \
    extern "C" __global__ void NAME(float* p, float* m, float* v, const void* g,         \
                                    u16* out, u64 n, AdamConsts c) {                     \
        adamw_body<GK, OK, L2>(p, m, v, g, out, n, c);                                   \
    }

ADAMW_KERNEL(adamw_f32_none_adamw, 0, 0, false)
ADAMW_KERNEL(adamw_f32_f16_adamw, 0, 1, false)
ADAMW_KERNEL(adamw_f32_bf16_adamw, 0, 2, false)
ADAMW_KERNEL(adamw_f16_none_adamw, 1, 0, false)
ADAMW_KERNEL(adamw_f16_f16_adamw, 1, 1, false)
ADAMW_KERNEL(adamw_f16_bf16_adamw, 1, 2, false)
ADAMW_KERNEL(adamw_bf16_none_adamw, 2, 0, false)
ADAMW_KERNEL(adamw_bf16_f16_adamw, 2, 1, false)
ADAMW_KERNEL(adamw_bf16_bf16_adamw, 2, 2, false)
ADAMW_KERNEL(adamw_f32_none_l2, 0, 0, true)
ADAMW_KERNEL(adamw_f32_f16_l2, 0, 1, true)
ADAMW_KERNEL(adamw_f32_bf16_l2, 0, 2, true)
ADAMW_KERNEL(adamw_f16_none_l2, 1, 0, true)
ADAMW_KERNEL(adamw_f16_f16_l2, 1, 1, true)
ADAMW_KERNEL(adamw_f16_bf16_l2, 1, 2, true)
ADAMW_KERNEL(adamw_bf16_none_l2, 2, 0, true)
ADAMW_KERNEL(adamw_bf16_f16_l2, 2, 1, true)
ADAMW_KERNEL(adamw_bf16_bf16_l2, 2, 2, true)
