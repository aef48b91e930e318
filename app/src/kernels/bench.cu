// Kernels of `tidestore bench` on a GPU (src/gpu.rs compiles this file with NVRTC at
// run time, `--fmad=false`). Both reproduce, bit for bit, what src/bench.rs computes on
// the host:
//
// - bench_checksum: the wrapping sum of the little-endian u64 words of bytes [p, p + n),
//   counted from p (the last word zero-padded), added into *acc with atomicAdd. Wrapping
//   addition is associative and commutative, so the order threads add in does not
//   matter. p may have any alignment: the range is read as the 8-aligned words that
//   cover it (bytes outside the range masked to zero, and never loaded), and each is
//   rotated right by 8 * (p mod 8) bits, which puts every byte at its position in the
//   range's own word; a word's bytes occupy disjoint bits, so the sum of the rotated
//   aligned words is the sum of the range's words.
// - bench_grad_fill: element k of a bf16 gradient, k in [0, n): splitmix64 of
//   (seed, first + k) -> the top 24 bits as an f32 in [-1, 1) -> times `scale` -> bf16
//   rounded to nearest even (the `half` crate's integer rule, NaN kept quiet).
//
// Every float operation is an explicit round-to-nearest intrinsic, so the compiler
// cannot contract or reorder them.

__device__ __forceinline__ u64 rotr64(u64 x, u32 r) {
    return r == 0u ? x : (x >> r) | (x << (64u - r));
}

// The aligned word k of the range, bytes outside [lo, hi) (offsets from the aligned
// base) zero; only bytes inside are loaded.
__device__ __forceinline__ u64 edge_word(const u8* base, u64 k, u64 lo, u64 hi) {
    u64 w = 0;
    for (u32 b = 0; b < 8u; b++) {
        u64 at = k * 8u + b;
        if (at >= lo && at < hi) {
            w |= (u64)base[at] << (8u * b);
        }
    }
    return w;
}

extern "C" __global__ void bench_checksum(const u8* p, u64 n, u64* acc) {
    u32 shift = (u32)((u64)p & 7u);
    const u8* base = p - shift;  // 8-aligned, at or before p
    u64 lo = shift;              // the range, as offsets from base
    u64 hi = shift + n;
    u64 words = (hi + 7u) / 8u;  // aligned words that hold a byte of the range
    u32 rot = 8u * shift;
    u64 sum = 0;
    u64 stride = (u64)blockDim.x * (u64)gridDim.x;
    for (u64 k = (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x; k < words; k += stride) {
        u64 w;
        if (k * 8u >= lo && k * 8u + 8u <= hi) {
            w = ((const u64*)base)[k];
        } else {
            w = edge_word(base, k, lo, hi);
        }
        sum += rotr64(w, rot);
    }
    // Every thread of the warp reaches this point (no early exit above).
    for (u32 off = 16u; off > 0u; off >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, off);
    }
    if ((threadIdx.x & 31u) == 0u && sum != 0u) {
        atomicAdd(acc, sum);
    }
}

__device__ __forceinline__ u64 splitmix64(u64 seed, u64 index) {
    u64 z = seed + (index + 1u) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The top 24 bits as an f32 in [-1, 1): exact in every step.
__device__ __forceinline__ float unit_f32(u64 x) {
    return __fsub_rn(__fdiv_rn(__ull2float_rn(x >> 40), 8388608.0f), 1.0f);
}

extern "C" __global__ void bench_grad_fill(u16* out, u64 n, u64 seed, u64 first, float scale) {
    u64 stride = (u64)blockDim.x * (u64)gridDim.x;
    for (u64 k = (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x; k < n; k += stride) {
        float x = unit_f32(splitmix64(seed, first + k));
        out[k] = f32_to_bf16_bits(__fmul_rn(x, scale));
    }
}
