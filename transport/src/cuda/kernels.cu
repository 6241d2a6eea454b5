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

// Block-scaled FP8 (reshard::quant), on f32 bits. Float arithmetic is
// IEEE single precision, rounded to nearest even, never contracted into a
// fused multiply-add: the intrinsics on the device, plain C on the host.
typedef unsigned char u8;
#ifdef __CUDACC__
#define REFIT_F32(b) __int_as_float((int)(b))
#define REFIT_BITS(f) ((u32)__float_as_int(f))
#define REFIT_MUL(a, b) __fmul_rn((a), (b))
#define REFIT_ADD(a, b) __fadd_rn((a), (b))
#define REFIT_DIV(a, b) __fdiv_rn((a), (b))
#else
#include <string.h>
static inline float refit_float_of(u32 b) { float f; memcpy(&f, &b, 4); return f; }
static inline u32 refit_bits_of(float f) { u32 b; memcpy(&b, &f, 4); return b; }
#define REFIT_F32(b) refit_float_of(b)
#define REFIT_BITS(f) refit_bits_of(f)
#define REFIT_MUL(a, b) ((a) * (b))
#define REFIT_ADD(a, b) ((a) + (b))
#define REFIT_DIV(a, b) ((a) / (b))
#endif

// The e4m3 (float8_e4m3fn) code of f32 bits: reshard::quant::e4m3_from_f32.
REFIT_FN u8 refit_e4m3(u32 bits) {
    u32 sign = (bits >> 24) & 0x80u;
    u32 abs = bits & 0x7fffffffu;
    // At or above 2^-6: 3 mantissa bits, half to even; rebias 127 -> 7.
    u32 normal = ((abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20) - (120u << 3);
    // Below: steps of 2^-9, rounded by adding 2^23.
    u32 sub = REFIT_BITS(REFIT_ADD(REFIT_MUL(REFIT_F32(abs), 512.0f), 8388608.0f)) - 0x4b000000u;
    u32 code = abs < 0x3c800000u ? sub : (normal < 0x7eu ? normal : 0x7eu);
    if (abs > 0x7f800000u) {
        code = 0x7fu;
    }
    return (u8)(sign | code);
}

// A block's scale (bits) from its largest magnitude (bits, sign clear):
// reshard::quant::block_scale.
REFIT_FN u32 refit_block_scale(u32 amax) {
    if (amax == 0u) {
        return 0x3f800000u;
    }
    return REFIT_BITS(REFIT_DIV(REFIT_F32(amax), 448.0f));
}

// One element's code with its block's scale: reshard::quant::quantize_value.
REFIT_FN u8 refit_quantize(u32 x, u32 s) {
    if ((x & 0x7fffffffu) == 0u) {
        return (u8)((x >> 24) & 0x80u);
    }
    return refit_e4m3(REFIT_BITS(REFIT_DIV(REFIT_F32(x), REFIT_F32(s))));
}

// Element i of a staged buffer as f32 bits: dt 0 f32, 1 bf16, 2 f16.
REFIT_FN u32 refit_staged(const void* p, u64 i, u64 dt) {
    if (dt == 0u) {
        return ((const u32*)p)[i];
    }
    if (dt == 1u) {
        return refit_bf16_to_f32(((const u16*)p)[i]);
    }
    return refit_f16_to_f32(((const u16*)p)[i]);
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
// 16-byte units: one vector load and store per thread (ld/st.global.v4).
struct alignas(16) refit_u128 {
    u32 a, b, c, d;
};
REFIT_FN refit_u128 refit_same128(refit_u128 v) { return v; }
REFIT_STRIDED(refit_strided_copy128, refit_u128, refit_u128, refit_same128)

// Block-scaled FP8, step 1: the scale of every block of a staged box (whole
// blocks, stored row-major from element sb with strides ss, innermost
// first), one thread block (256 threads) per block of the box's grid
// (g0 x g1 x g2 blocks from grid index o). A block's elements start at
// (o + cell) * b and stop at the tensor's shape n; s is the box's first
// element. The scale goes to scales[base + cell, row-major]; a block
// holding NaN or infinity writes NaN there and its index to *err (the
// smallest such index wins).
extern "C" __global__ void refit_fp8_scales(const void* staged, u32* scales, u32* err, u64 dt,
                                            u64 g0, u64 g1, u64 g2, u64 o0, u64 o1, u64 o2,
                                            u64 b0, u64 b1, u64 b2, u64 n0, u64 n1, u64 n2,
                                            u64 s0, u64 s1, u64 s2, u64 sb, u64 ss0, u64 ss1, u64 ss2,
                                            u64 base) {
    __shared__ u32 top[256];
    for (u64 z = blockIdx.z; z < g2; z += gridDim.z) {
        for (u64 y = blockIdx.y; y < g1; y += gridDim.y) {
            for (u64 x = blockIdx.x; x < g0; x += gridDim.x) {
                u64 e0 = (o0 + x) * b0, e1 = (o1 + y) * b1, e2 = (o2 + z) * b2;
                u64 c0 = n0 - e0 < b0 ? n0 - e0 : b0;
                u64 c1 = n1 - e1 < b1 ? n1 - e1 : b1;
                u64 c2 = n2 - e2 < b2 ? n2 - e2 : b2;
                u64 at = sb + (e0 - s0) * ss0 + (e1 - s1) * ss1 + (e2 - s2) * ss2;
                u32 m = 0u;
                // A block's rows are few: 32-bit index arithmetic.
                u32 w0 = (u32)c0, rows = (u32)(c0 * c1);
                for (u64 k = 0; k < c2; k++) {
                    for (u32 r = threadIdx.x; r < rows; r += blockDim.x) {
                        u64 i = r % w0, j = r / w0;
                        u32 v = refit_staged(staged, at + i * ss0 + j * ss1 + k * ss2, dt) & 0x7fffffffu;
                        m = v > m ? v : m;
                    }
                }
                top[threadIdx.x] = m;
                __syncthreads();
                for (u32 half = blockDim.x / 2u; half > 0u; half /= 2u) {
                    if (threadIdx.x < half && top[threadIdx.x + half] > top[threadIdx.x]) {
                        top[threadIdx.x] = top[threadIdx.x + half];
                    }
                    __syncthreads();
                }
                if (threadIdx.x == 0u) {
                    u64 cell = base + x + g0 * (y + g1 * z);
                    if (top[0] >= 0x7f800000u) {
                        atomicMin(err, (u32)cell);
                        scales[cell] = 0x7fc00000u;
                    } else {
                        scales[cell] = refit_block_scale(top[0]);
                    }
                }
                __syncthreads();
            }
        }
    }
}

// Block-scaled FP8, step 2: the codes of a box of elements (c0 x c1 x c2,
// innermost first, starting at global index f) read from the staged
// buffer at sb + i*ss0 + j*ss1 + k*ss2 and written to the weights at
// wb + i*ws0 + j*ws1 + k*ws2, each with the scale of its block:
// scales[base + sum_d ((f_d + i_d) / b_d - o_d) * gs_d] (gs0 = 1). Launch
// with kernels::launch_3d(c).
extern "C" __global__ void refit_fp8_codes(const void* staged, u8* weights, const u32* scales, u64 dt,
                                           u64 c0, u64 c1, u64 c2, u64 sb, u64 ss0, u64 ss1, u64 ss2,
                                           u64 wb, u64 ws0, u64 ws1, u64 ws2, u64 f0, u64 f1, u64 f2,
                                           u64 b0, u64 b1, u64 b2, u64 o0, u64 o1, u64 o2,
                                           u64 gs1, u64 gs2, u64 base) {
    u64 sx = (u64)gridDim.x * blockDim.x;
    for (u64 k = blockIdx.z; k < c2; k += gridDim.z) {
        for (u64 j = blockIdx.y; j < c1; j += gridDim.y) {
            u64 row = base + ((f1 + j) / b1 - o1) * gs1 + ((f2 + k) / b2 - o2) * gs2;
            for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < c0; i += sx) {
                u64 col = f0 + i;
                // 32-bit division where it fits (every real tensor).
                u64 cell = ((col | b0) >> 32) == 0 ? (u64)((u32)col / (u32)b0) : col / b0;
                u32 s = scales[row + cell - o0];
                weights[wb + i * ws0 + j * ws1 + k * ws2] =
                    refit_quantize(refit_staged(staged, sb + i * ss0 + j * ss1 + k * ss2, dt), s);
            }
        }
    }
}
#endif
