// The integer types and 16-bit float conversions of tidestore's CUDA kernels, compiled
// ahead of each kernel source that uses them (the optimizer's AdamW, the bench's): integer
// code matching the `half` crate bit for bit (round to nearest even, NaN keeps its
// payload with the quiet bit set, subnormals exact, overflow to inf), so the bits a GPU
// writes are the bits the CPU would have written.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

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
