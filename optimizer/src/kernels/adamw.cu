// tidestore GPU AdamW: the same f32 arithmetic, in the same order, as the CPU kernel
// (optimizer/src/params.rs, `Consts`; optimizer/src/cpu/scalar.rs, `adam`), so a group
// updated on the GPU gives the bits the CPU would have given.
//
// Every rounding step is explicit: __fmaf_rn / __fmul_rn / __fsqrt_rn / __fdiv_rn, and
// the program is compiled with --fmad=false so nothing else is contracted. The integer
// types and the 16-bit conversions come from half_bits.cuh, compiled ahead of this file
// (`ADAMW_CU` is the two).
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
