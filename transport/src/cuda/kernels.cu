// Device casts and strided copy-casts for the GPU data plane
// (transport/src/cuda/kernels.rs). Conversions are integer code written to
// give exactly the host's results (reshard::dtype: round to nearest, ties
// to even; NaN stays NaN with its sign; overflow gives infinity), so the
// same functions compile as C on the host and are checked there against
// the host conversion (kernels.rs tests), with no GPU.

#ifdef __CUDACC__
#define REFIT_FN __device__ __forceinline__
#else
#define REFIT_FN static inline
#define __global__
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// f32 bits to bf16 bits.
REFIT_FN u16 refit_f32_to_bf16(u32 v) {
    if ((v & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((v >> 16) | 0x0040u);
    }
    return (u16)((v + 0x7fffu + ((v >> 16) & 1u)) >> 16);
}

REFIT_FN u32 refit_bf16_to_f32(u16 h) {
    return ((u32)h) << 16;
}

// f32 bits to f16 bits.
REFIT_FN u16 refit_f32_to_f16(u32 v) {
    u32 sign = (v >> 16) & 0x8000u;
    u32 abs = v & 0x7fffffffu;
    if (abs > 0x7f800000u) {
        // NaN: the quiet NaN, sign kept (the host drops the payload too).
        return (u16)(sign | 0x7e00u);
    }
    if (abs >= 0x477ff000u) {
        // At or past the midpoint above 65504: infinity.
        return (u16)(sign | 0x7c00u);
    }
    if (abs >= 0x38800000u) {
        // Normal in f16: rebias the exponent (127 -> 15), round 13 bits.
        u32 r = abs + 0xfffu + ((abs >> 13) & 1u);
        return (u16)(sign | ((r >> 13) - (112u << 10)));
    }
    if (abs < 0x33000000u) {
        // At or below half the smallest subnormal (2^-25): zero.
        return (u16)sign;
    }
    // Subnormal in f16: the significand with its implicit bit, shifted.
    u32 e = abs >> 23;
    u32 sig = (abs & 0x7fffffu) | 0x800000u;
    u32 shift = 126u - e; // 14 ..= 24
    u32 q = sig >> shift;
    u32 rem = sig & ((1u << shift) - 1u);
    u32 half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) {
        q += 1u;
    }
    return (u16)(sign | q);
}

REFIT_FN u32 refit_f16_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1fu;
    u32 man = (u32)h & 0x3ffu;
    if (exp == 0x1fu) {
        // Infinity, or the quiet NaN with its sign (as the host gives).
        return sign | (man ? 0x7fc00000u : 0x7f800000u);
    }
    if (exp != 0u) {
        return sign | ((exp + 112u) << 23) | (man << 13);
    }
    if (man == 0u) {
        return sign;
    }
    // Subnormal: normalise.
    u32 e = 113u;
    while (!(man & 0x400u)) {
        man <<= 1;
        e -= 1u;
    }
    return sign | (e << 23) | ((man & 0x3ffu) << 13);
}

// bf16 bits to f16 bits and back: widened to f32 (exact), then rounded
// once, which is what the host gives (it rounds the exact value once).
REFIT_FN u16 refit_bf16_to_f16(u16 h) {
    return refit_f32_to_f16(refit_bf16_to_f32(h));
}

REFIT_FN u16 refit_f16_to_bf16(u16 h) {
    return refit_f32_to_bf16(refit_f16_to_f32(h));
}

#ifdef __CUDACC__
// Element-wise casts, grid-stride: launch with kernels::launch_1d(n).
#define REFIT_CAST(name, from_t, to_t, f)                                                   \
    extern "C" __global__ void name(const from_t* src, to_t* dst, u64 n) {                  \
        u64 stride = (u64)gridDim.x * blockDim.x;                                          \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {     \
            dst[i] = f(src[i]);                                                             \
        }                                                                                   \
    }
REFIT_CAST(refit_cast_f32_bf16, u32, u16, refit_f32_to_bf16)
REFIT_CAST(refit_cast_bf16_f32, u16, u32, refit_bf16_to_f32)
REFIT_CAST(refit_cast_f32_f16, u32, u16, refit_f32_to_f16)
REFIT_CAST(refit_cast_f16_f32, u16, u32, refit_f16_to_f32)

// A strided box of up to 3 dimensions (counts[0] innermost), copied and
// cast: element (i, j, k) from src[sb + i*ss0 + j*ss1 + k*ss2] to
// dst[db + i*ds0 + j*ds1 + k*ds2] (element units). Launch with
// kernels::launch_3d(counts): x covers the innermost dimension, y and z
// stride over the others.
#define REFIT_STRIDED(name, from_t, to_t, f)                                                \
    extern "C" __global__ void name(const from_t* src, to_t* dst, u64 c0, u64 c1, u64 c2,   \
                                    u64 sb, u64 ss0, u64 ss1, u64 ss2,                      \
                                    u64 db, u64 ds0, u64 ds1, u64 ds2) {                    \
        u64 sx = (u64)gridDim.x * blockDim.x;                                              \
        for (u64 k = blockIdx.z; k < c2; k += gridDim.z) {                                 \
            for (u64 j = blockIdx.y; j < c1; j += gridDim.y) {                             \
                for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < c0; i += sx) { \
                    dst[db + i * ds0 + j * ds1 + k * ds2] =                                \
                        f(src[sb + i * ss0 + j * ss1 + k * ss2]);                          \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }
REFIT_FN u32 refit_same32(u32 v) { return v; }
REFIT_FN u16 refit_same16(u16 v) { return v; }
REFIT_STRIDED(refit_strided_f32_bf16, u32, u16, refit_f32_to_bf16)
REFIT_STRIDED(refit_strided_bf16_f32, u16, u32, refit_bf16_to_f32)
REFIT_STRIDED(refit_strided_f32_f16, u32, u16, refit_f32_to_f16)
REFIT_STRIDED(refit_strided_f16_f32, u16, u32, refit_f16_to_f32)
REFIT_STRIDED(refit_strided_bf16_f16, u16, u16, refit_bf16_to_f16)
REFIT_STRIDED(refit_strided_f16_bf16, u16, u16, refit_f16_to_bf16)
REFIT_STRIDED(refit_strided_copy32, u32, u32, refit_same32)
REFIT_STRIDED(refit_strided_copy16, u16, u16, refit_same16)
#endif
