/* One decode row's routed experts on the CPU, read from the file's own blocks where they lie
 * (engine/hardware/native.py builds this file with the machine's C compiler and loads it;
 * engine/runtime/models/cpu_native.py runs it; DESIGN.md "Experts in host memory").
 *
 *   carve_experts(...): y = sum_j w[j] * down_e(act(gate_e x) * up_e x), e = ids[j]
 *
 * Every expert matrix is GGUF's [n_expert][rows][cols] of blocks (Q4_0, Q4_1, Q5_0, Q5_1,
 * Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K, Q8_0, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_XS, IQ4_NL,
 * MXFP4). x and the GLU's output h are quantized to int8 per run of 256 where a K-quant is
 * among the types, else per 32 (as llama.cpp's CPU does: its q8_K and q8_0), each block's
 * products summed in integers, the rest in float32. gpt-oss's experts add a bias to every
 * product and clamp their SwiGLU. One OpenMP region per call: the gate/up rows of all chosen
 * experts shared among the threads, a barrier, then the down rows. */

#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* ggml's type numbers */
enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
    T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ4_NL = 20, T_IQ3_S = 21,
    T_IQ2_S = 22, T_IQ4_XS = 23, T_IQ1_M = 29, T_MXFP4 = 39
};

/* the 16 values a 4-bit index stands for: MXFP4's e2m1 values (doubled) and the IQ4 types'
 * non-linear ones, set once by the loader from the gguf package's tables
 * (carve_set_values); a type is refused until its table is set */
static int8_t mxfp4_values[16], iq4nl_values[16];
static int mxfp4_set = 0, iq4nl_set = 0;
/* MXFP4's e8m0 scale byte e as the float 2^(e - 128) (halved as its values are doubled), filled
 * with them: a lookup where ldexpf per block of 32 cost more than the block's products */
static float e8m0_half[256];

/* the grids of magnitudes of the IQ2 / IQ3 types (IQ2_XXS 256 x 8, IQ2_XS 512 x 8, IQ2_S
 * 1024 x 8, IQ3_XXS 256 x 4, IQ3_S 512 x 4; IQ1_S / IQ1_M's 2048 x 8 of -1, 0, 1, held plus
 * one) and the 128 sign bytes of IQ2_XXS / IQ2_XS / IQ3_XXS (8 sign bits from a 7-bit index,
 * the eighth making the count of minus signs even), set once by the loader from the gguf
 * package's tables (carve_set_grid) */
static uint8_t iq2xxs_grid[256][8], iq2xs_grid[512][8], iq2s_grid[1024][8];
static uint8_t iq3xxs_grid[256][4], iq3s_grid[512][4], iq1_grid[2048][8], ksigns[128];
static int iq2xxs_set = 0, iq2xs_set = 0, iq2s_set = 0, iq3xxs_set = 0, iq3s_set = 0;
static int iq1_set = 0;

int carve_set_grid(int type, const uint8_t *grid, const uint8_t *signs) {
    void *to;
    size_t n;
    int *set;
    switch (type) {
    case T_IQ2_XXS: to = iq2xxs_grid, n = sizeof iq2xxs_grid, set = &iq2xxs_set; break;
    case T_IQ2_XS: to = iq2xs_grid, n = sizeof iq2xs_grid, set = &iq2xs_set; break;
    case T_IQ2_S: to = iq2s_grid, n = sizeof iq2s_grid, set = &iq2s_set; break;
    case T_IQ3_XXS: to = iq3xxs_grid, n = sizeof iq3xxs_grid, set = &iq3xxs_set; break;
    case T_IQ3_S: to = iq3s_grid, n = sizeof iq3s_grid, set = &iq3s_set; break;
    case T_IQ1_S: case T_IQ1_M: to = iq1_grid, n = sizeof iq1_grid, set = &iq1_set; break;
    default: return -1;
    }
    memcpy(to, grid, n);
    memcpy(ksigns, signs, sizeof ksigns);
    *set = 1;
    return 0;
}

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

int carve_set_values(int type, const int8_t *values) {
    if (type == T_MXFP4) {
        memcpy(mxfp4_values, values, 16);
        for (int e = 0; e < 256; e++)
            e8m0_half[e] = ldexpf(1.0f, e - 128);
        mxfp4_set = 1;
    } else if (type == T_IQ4_NL) {
        memcpy(iq4nl_values, values, 16);
        iq4nl_set = 1;
    } else {
        return -1;
    }
    return 0;
}

static float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__) && defined(__AVX2__)
    return _cvtsh_ss(h); /* one instruction where the CPU converts half floats */
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 113;
            while (!(man & 1024)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* x quantized as llama.cpp's q8_K (g = 256) or q8_0 (g = 32) copies are: per run of g values
 * an int8 vector and one scale (max |x| / 127), and the integer sums of each 16 of them (the
 * K-quants' min terms and Q6_K's offset), so that a block's products are summed in integers */
typedef struct {
    const int8_t *q;     /* n values */
    const float *d;      /* n / g scales */
    const int16_t *s16;  /* n / 16 sums of q (each within +-16 * 127) */
    const int16_t *s32;  /* n / 32 sums of q (within +-32 * 127) */
    int g;               /* values per scale: 256 or 32 */
    int sh;              /* log2(g / 32): block i of 32 takes scale d[i >> sh] */
} qx_t;

static void quantize(const float *x, int n, int gs, int8_t *q, float *d, int16_t *s16,
                     int16_t *s32) {
    for (int g = 0; g < n / gs; g++) {
        const float *v = x + gs * g;
        float amax = 0.0f;
        for (int l = 0; l < gs; l++) {
            float a = fabsf(v[l]);
            amax = a > amax ? a : amax;
        }
        float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
        for (int l = 0; l < gs; l++)
            q[gs * g + l] = (int8_t)lrintf(v[l] * id);
        d[g] = dd;
    }
    for (int g = 0; g < n / 16; g++) {
        int32_t t = 0;
        for (int l = 0; l < 16; l++)
            t += q[16 * g + l];
        s16[g] = (int16_t)t;
    }
    for (int g = 0; g < n / 32; g++)
        s32[g] = (int16_t)(s16[2 * g] + s16[2 * g + 1]);
}

/* Q4_K / Q5_K: a block's 12 bytes of six-bit sub-block scales and mins unpacked, 8 scale
 * bytes into sc and 8 min bytes into m (four of each whole in the first 8 bytes' low 6 bits,
 * the other four split between the last 4 bytes' nibbles and the first 8 bytes' top 2 bits):
 * as 32-bit words, a few masks and shifts */
static inline void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t a[3], w[4];
    memcpy(a, s, 12);
    w[0] = a[0] & 0x3f3f3f3fu;
    w[1] = (a[2] & 0x0f0f0f0fu) | (((a[0] >> 6) & 0x03030303u) << 4);
    w[2] = a[1] & 0x3f3f3f3fu;
    w[3] = ((a[2] >> 4) & 0x0f0f0f0fu) | (((a[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, w, 8);
    memcpy(m, w + 2, 8);
}

/* the sum of a block's 8 mins times x's sums over its sub-blocks of 32 (s32) */
static inline int32_t k_mins(const uint8_t m[8], const int16_t *s32) {
#ifdef __AVX2__
    __m128i p = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)m)),
                               _mm_loadu_si128((const __m128i *)s32));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0x4e));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0xb1));
    return _mm_cvtsi128_si32(p);
#else
    int32_t t = 0;
    for (int j = 0; j < 8; j++)
        t += m[j] * s32[j];
    return t;
#endif
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 unsigned bytes (< 64) times 32 int8, each pair's sum times its 16-bit scale (sc: 16
 * int16, one per pair) -> 8 int32 */
static inline __m256i udot_scaled(__m256i u, const int8_t *q, __m256i sc) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)q)),
                             sc);
}

/* 32 signed bytes v times 32 int8 x, each pair's sum times its 16-bit scale -> 8 int32:
 * maddubs takes unsigned times signed, so |v| times x with v's sign (v = -128 reads as the
 * unsigned 128 it stands for) */
static inline __m256i sdot_scaled(__m256i v, __m256i x, __m256i sc) {
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v)), sc);
}

/* the sum of 8 int32 lanes */
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_hadd_epi32(s, s);
    return _mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
}
#endif

/* the dot product of one row of n values with x (quantized) */
static float dot_q4_k(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
#ifdef __AVX2__
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 vacc = _mm256_setzero_ps();
#endif
    for (int i = 0; i < n / 256; i++, b += 144) {
        const uint8_t *q = b + 16;
        const int8_t *xq = x.q + 256 * i;
        uint8_t sc[8], m[8];
        k_scales(b + 4, sc, m);
        const int32_t mins = k_mins(m, x.s32 + 8 * i);
        float d = f16(b) * x.d[i];
        acc -= f16(b + 2) * x.d[i] * (float)mins;
#ifdef __AVX2__
        __m256i iacc = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            __m256i lo = _mm256_and_si256(qv, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);
            iacc = _mm256_add_epi32(iacc, udot_scaled(lo, xq + 64 * c,
                                                      _mm256_set1_epi16((short)sc[2 * c])));
            iacc = _mm256_add_epi32(iacc, udot_scaled(hi, xq + 64 * c + 32,
                                                      _mm256_set1_epi16((short)sc[2 * c + 1])));
        }
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_set1_ps(d), vacc);
#else
        int32_t isum = 0;
        for (int c = 0; c < 4; c++) {
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 32; l++) {
                lo += (int32_t)(q[32 * c + l] & 15) * (int32_t)xq[64 * c + l];
                hi += (int32_t)(q[32 * c + l] >> 4) * (int32_t)xq[64 * c + 32 + l];
            }
            isum += sc[2 * c] * lo + sc[2 * c + 1] * hi;
        }
        acc += d * (float)isum;
#endif
    }
#ifdef __AVX2__
    acc += hsum8(vacc);
#endif
    return acc;
}

static float dot_q5_k(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
#ifdef __AVX2__
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
#endif
    for (int i = 0; i < n / 256; i++, b += 176) {
        const uint8_t *qh = b + 16, *q = b + 48;
        const int8_t *xq = x.q + 256 * i;
        uint8_t sc[8], m[8];
        k_scales(b + 4, sc, m);
        int32_t mins = k_mins(m, x.s32 + 8 * i), isum = 0;
#ifdef __AVX2__
        const __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
        __m256i iacc = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c), one);
            __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c + 1), one);
            __m256i lo = _mm256_or_si256(_mm256_and_si256(qv, m4), _mm256_slli_epi16(h0, 4));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qv, 4), m4),
                                         _mm256_slli_epi16(h1, 4));
            iacc = _mm256_add_epi32(iacc, udot_scaled(lo, xq + 64 * c,
                                                      _mm256_set1_epi16((short)sc[2 * c])));
            iacc = _mm256_add_epi32(iacc, udot_scaled(hi, xq + 64 * c + 32,
                                                      _mm256_set1_epi16((short)sc[2 * c + 1])));
        }
        isum = hsum_i32(iacc);
#else
        for (int c = 0; c < 4; c++) {
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 32; l++) {
                lo += (int32_t)((q[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4))
                      * (int32_t)xq[64 * c + l];
                hi += (int32_t)((q[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4))
                      * (int32_t)xq[64 * c + 32 + l];
            }
            isum += sc[2 * c] * lo + sc[2 * c + 1] * hi;
        }
#endif
        acc += x.d[i] * (f16(b) * (float)isum - f16(b + 2) * (float)mins);
    }
    return acc;
}

static float dot_q6_k(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
#ifdef __AVX2__
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    __m256 vacc = _mm256_setzero_ps();
#endif
    for (int i = 0; i < n / 256; i++, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192), *xq = x.q + 256 * i;
        float d = f16(b + 208) * x.d[i];
        /* the values' offset of -32: 32 * sum of scale * q over each 16 */
#ifdef __AVX2__
        int32_t off = hsum_i32(_mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)),
            _mm256_loadu_si256((const __m256i *)(x.s16 + 16 * i))));
#else
        int32_t off = 0;
        for (int g = 0; g < 16; g++)
            off += sc[g] * x.s16[16 * i + g];
#endif
        acc -= 32.0f * d * (float)off;
#ifdef __AVX2__
        __m256i iacc = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            const uint8_t *l0 = ql + 64 * half, *h0 = qh + 32 * half;
            const int8_t *s = sc + 8 * half, *xh = xq + 128 * half;
            __m256i a = _mm256_loadu_si256((const __m256i *)l0);
            __m256i c = _mm256_loadu_si256((const __m256i *)(l0 + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)h0);
            __m256i v[4];
            v[0] = _mm256_or_si256(_mm256_and_si256(a, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
            v[1] = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
            v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                   _mm256_slli_epi16(
                                       _mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
            v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                   _mm256_slli_epi16(
                                       _mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
            for (int r = 0; r < 4; r++) {
                __m256i scv = _mm256_set_m128i(_mm_set1_epi16(s[2 * r + 1]),
                                               _mm_set1_epi16(s[2 * r]));
                iacc = _mm256_add_epi32(iacc, udot_scaled(v[r], xh + 32 * r, scv));
            }
        }
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_set1_ps(d), vacc);
#else
        int32_t isum = 0;
        for (int half = 0; half < 2; half++) {
            const uint8_t *l0 = ql + 64 * half, *h0 = qh + 32 * half;
            const int8_t *s = sc + 8 * half, *xh = xq + 128 * half;
            for (int l = 0; l < 32; l++) {
                int g = l / 16;
                isum += s[g] * (int32_t)((l0[l] & 15) | (((h0[l] >> 0) & 3) << 4)) * xh[l];
                isum += s[g + 2] * (int32_t)((l0[l + 32] & 15) | (((h0[l] >> 2) & 3) << 4))
                        * xh[l + 32];
                isum += s[g + 4] * (int32_t)((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4))
                        * xh[l + 64];
                isum += s[g + 6] * (int32_t)((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4))
                        * xh[l + 96];
            }
        }
        acc += d * (float)isum;
#endif
    }
#ifdef __AVX2__
    acc += hsum8(vacc);
#endif
    return acc;
}

static float dot_q8_0(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
#ifdef __AVX2__
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 vacc = _mm256_setzero_ps();
#endif
    for (int i = 0; i < n / 32; i++, b += 34) {
        const int8_t *q = (const int8_t *)(b + 2), *xq = x.q + 32 * i;
        float d = f16(b) * x.d[i >> x.sh];
#ifdef __AVX2__
        __m256i v = _mm256_loadu_si256((const __m256i *)q);
        __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sdot_scaled(v, xv, ones)), _mm256_set1_ps(d),
                               vacc);
#else
        int32_t s = 0;
        for (int l = 0; l < 32; l++)
            s += (int32_t)q[l] * (int32_t)xq[l];
        acc += d * (float)s;
#endif
    }
#ifdef __AVX2__
    acc += hsum8(vacc);
#endif
    return acc;
}

/* Q4_0, Q4_1, Q5_0, Q5_1: per 32 values d (and Q4_1 / Q5_1's float offset m), 16 bytes of
 * low nibbles (the first 16 values in the low halves), Q5's 32 fifth bits in a word before
 * them; w = d (q - 8) / d (q - 16) for Q4_0 / Q5_0, d q + m for Q4_1 / Q5_1. The integer sum
 * of q x, then the offset times x's sum (s16) in float. ``bits``: 4 or 5; ``m``: whether the
 * block carries m. */
static float dot_q4_q5(const uint8_t *b, qx_t x, int n, int bits, int m) {
    const int size = 18 + 2 * m + 4 * (bits == 5), q0 = 2 + 2 * m + 4 * (bits == 5);
    const int32_t off = m ? 0 : (bits == 5 ? 16 : 8);
    float acc = 0.0f;
#ifdef __AVX2__
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    /* byte j of the 32 gets bit j of the fifth bits' word */
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256 vacc = _mm256_setzero_ps();
#endif
    for (int i = 0; i < n / 32; i++, b += size) {
        const uint8_t *q = b + q0;
        const int8_t *xq = x.q + 32 * i;
        int32_t sx = x.s32[i];
        uint32_t qh = bits == 5 ? le32(b + 2 + 2 * m) : 0;
        const float dx = x.d[i >> x.sh], db = f16(b);
#ifdef __AVX2__
        __m128i raw = _mm_loadu_si128((const __m128i *)q);
        __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
        if (bits == 5) {
            __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
            h = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
            v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(16)));
        }
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot_scaled(v, xq, ones)),
                               _mm256_set1_ps(db * dx), vacc);
        int32_t s = 0;  /* in vacc */
#else
        int32_t s = 0;
        for (int l = 0; l < 16; l++) {
            int32_t lo = q[l] & 15, hi = q[l] >> 4;
            if (bits == 5) {
                lo |= (int32_t)((qh >> l) & 1) << 4;
                hi |= (int32_t)((qh >> (l + 16)) & 1) << 4;
            }
            s += lo * xq[l] + hi * xq[l + 16];
        }
#endif
        acc += dx * (db * (float)(s - off * sx) + (m ? f16(b + 2) * (float)sx : 0.0f));
    }
#ifdef __AVX2__
    acc += hsum8(vacc);
#endif
    return acc;
}

/* 32 values from 16 bytes of 4-bit indices into ``values`` (the first 16 in the low nibbles)
 * times 32 int8 x */
#ifndef __AVX2__
static int32_t nibble_dot(const int8_t *values, const uint8_t *q, const int8_t *xq) {
    int32_t s = 0;
    for (int l = 0; l < 16; l++)
        s += (int32_t)values[q[l] & 15] * xq[l] + (int32_t)values[q[l] >> 4] * xq[l + 16];
    return s;
}
#endif

#ifdef __AVX2__
/* the same with the 16 values in both halves of ``table``: 8 int32 lanes whose sum it is */
static inline __m256i nibble_dot8(__m256i table, const uint8_t *q, const int8_t *xq) {
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m128i raw = _mm_loadu_si128((const __m128i *)q);
    __m256i v = _mm256_shuffle_epi8(
        table, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4));
    return sdot_scaled(v, _mm256_loadu_si256((const __m256i *)xq), ones);
}
#endif

/* MXFP4: per 32 values a power-of-two scale (e8m0, halved as the values are doubled) and 16
 * bytes of 4-bit indices into the e2m1 values, the first 16 values in the low nibbles */
static float dot_mxfp4(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
#ifdef __AVX2__
    const __m128i t = _mm_loadu_si128((const __m128i *)mxfp4_values);
    const __m256i table = _mm256_set_m128i(t, t);
    __m256 vacc = _mm256_setzero_ps();
#endif
    for (int i = 0; i < n / 32; i++, b += 17) {
        const float d = e8m0_half[b[0]] * x.d[i >> x.sh];
#ifdef __AVX2__
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nibble_dot8(table, b + 1, x.q + 32 * i)),
                               _mm256_set1_ps(d), vacc);
#else
        acc += d * (float)nibble_dot(mxfp4_values, b + 1, x.q + 32 * i);
#endif
    }
#ifdef __AVX2__
    acc += hsum8(vacc);
#endif
    return acc;
}

/* Q2_K (84 bytes per 256): 16 sub-block scales and mins of 4 bits, 2-bit values (the 32
 * bytes of each half hold its 4 runs of 32 in bit pairs), d and dmin */
static float dot_q2_k(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 84) {
        const uint8_t *sc = b, *q = b + 16;
        const int8_t *xq = x.q + 256 * i;
        int32_t isum = 0;
#ifdef __AVX2__
        const __m128i sv = _mm_loadu_si128((const __m128i *)sc);
        const int32_t mins = hsum_i32(_mm256_madd_epi16(
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sv, 4), _mm_set1_epi8(15))),
            _mm256_loadu_si256((const __m256i *)(x.s16 + 16 * i))));
        const __m256i m3 = _mm256_set1_epi8(3);
        __m256i iacc = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * half));
            for (int j = 0; j < 4; j++) {  /* sub-blocks 8 half + 2 j and the next */
                int sb = 8 * half + 2 * j;
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), m3);
                __m256i scv = _mm256_set_m128i(_mm_set1_epi16((short)(sc[sb + 1] & 15)),
                                               _mm_set1_epi16((short)(sc[sb] & 15)));
                iacc = _mm256_add_epi32(iacc, udot_scaled(v, xq + 16 * sb, scv));
            }
        }
        isum = hsum_i32(iacc);
#else
        int32_t mins = 0;
        for (int sb = 0; sb < 16; sb++)
            mins += (sc[sb] >> 4) * x.s16[16 * i + sb];
        for (int sb = 0; sb < 16; sb++) {
            int half = sb / 8, shift = 2 * ((sb % 8) / 2), l0 = 16 * (sb % 2);
            int32_t s = 0;
            for (int l = 0; l < 16; l++)
                s += (int32_t)((q[32 * half + l0 + l] >> shift) & 3) * xq[16 * sb + l];
            isum += (sc[sb] & 15) * s;
        }
#endif
        acc += x.d[i] * (f16(b + 80) * (float)isum - f16(b + 82) * (float)mins);
    }
    return acc;
}

/* Q3_K (110 bytes per 256): a high-bit mask, 2-bit low values (as Q2_K's), 16 six-bit signed
 * scales (offset 32) packed in 12 bytes, d; a value is low - 4 where its mask bit is clear */
static float dot_q3_k(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 110) {
        const uint8_t *hm = b, *q = b + 32, *sc = b + 96;
        const int8_t *xq = x.q + 256 * i;
        /* the 16 scales as words: low nibbles from the first 8 bytes (the low halves for
         * sub-blocks 0-7, the high for 8-15), the top bit pairs from the last 4 */
        uint32_t a[3], w[4];
        memcpy(a, sc, 12);
        for (int k = 0; k < 4; k++)
            w[k] = ((k < 2 ? a[k] : a[k - 2] >> 4) & 0x0f0f0f0fu)
                   | (((a[2] >> (2 * k)) & 0x03030303u) << 4);
        uint8_t u6[16];
        int8_t scale[16];  /* 6-bit, less 32 */
        memcpy(u6, w, 16);
        for (int j = 0; j < 16; j++)
            scale[j] = (int8_t)(u6[j] - 32);
        /* a value is u - 4 with u = low bits + 4 * mask bit (0..7): the -4 by x's sums */
#ifdef __AVX2__
        int32_t isum = -4 * hsum_i32(_mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scale)),
            _mm256_loadu_si256((const __m256i *)(x.s16 + 16 * i))));
#else
        int32_t isum = 0;
        for (int sb = 0; sb < 16; sb++)
            isum -= 4 * scale[sb] * x.s16[16 * i + sb];
#endif
#ifdef __AVX2__
        const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
        const __m256i hv = _mm256_loadu_si256((const __m256i *)hm);
        __m256i iacc = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * half));
            for (int j = 0; j < 4; j++) {
                int sb = 8 * half + 2 * j;
                __m256i h = _mm256_and_si256(_mm256_srli_epi16(hv, 4 * half + j), one);
                __m256i v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), m3),
                                            _mm256_slli_epi16(h, 2));
                __m256i scv = _mm256_set_m128i(_mm_set1_epi16((short)scale[sb + 1]),
                                               _mm_set1_epi16((short)scale[sb]));
                iacc = _mm256_add_epi32(iacc, udot_scaled(v, xq + 16 * sb, scv));
            }
        }
        isum += hsum_i32(iacc);
#else
        for (int sb = 0; sb < 16; sb++) {
            int half = sb / 8, shift = 2 * ((sb % 8) / 2), l0 = 16 * (sb % 2), bit = sb / 2;
            int32_t s = 0;
            for (int l = 0; l < 16; l++) {
                int u = ((q[32 * half + l0 + l] >> shift) & 3) | (((hm[l0 + l] >> bit) & 1) << 2);
                s += u * xq[16 * sb + l];
            }
            isum += scale[sb] * s;
        }
#endif
        acc += x.d[i] * f16(b + 108) * (float)isum;
    }
    return acc;
}

/* IQ4_XS (136 bytes per 256): d, 8 six-bit signed scales (offset 32: low nibbles in 4 bytes,
 * high bit pairs in a 16-bit word), 4-bit indices into the non-linear values (per 32: the
 * first 16 in the low nibbles) */
static float dot_iq4_xs(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 136) {
        const uint8_t *sl = b + 4, *q = b + 8;
        const int8_t *xq = x.q + 256 * i;
        int sh = b[2] | (b[3] << 8);
        int32_t isum = 0;
#ifdef __AVX2__
        const __m256i m4 = _mm256_set1_epi8(15);
        const __m128i t = _mm_loadu_si128((const __m128i *)iq4nl_values);
        const __m256i table = _mm256_set_m128i(t, t);
        __m256i iacc = _mm256_setzero_si256();
#endif
        for (int ib = 0; ib < 8; ib++) {
            int scale = (((sl[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)) - 32;
#ifdef __AVX2__
            __m128i raw = _mm_loadu_si128((const __m128i *)(q + 16 * ib));
            __m256i v = _mm256_shuffle_epi8(
                table, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4));
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * ib));
            /* (|v| <= 127: a pair's sum stays within int16) */
            iacc = _mm256_add_epi32(iacc, sdot_scaled(v, xv, _mm256_set1_epi16((short)scale)));
#else
            isum += scale * nibble_dot(iq4nl_values, q + 16 * ib, xq + 32 * ib);
#endif
        }
#ifdef __AVX2__
        isum = hsum_i32(iacc);
#endif
        acc += x.d[i] * f16(b) * (float)isum;
    }
    return acc;
}

/* IQ4_NL (18 bytes per 32): d and 16 bytes of 4-bit indices into the non-linear values */
static float dot_iq4_nl(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
#ifdef __AVX2__
    const __m128i t = _mm_loadu_si128((const __m128i *)iq4nl_values);
    const __m256i table = _mm256_set_m128i(t, t);
    __m256 vacc = _mm256_setzero_ps();
#endif
    for (int i = 0; i < n / 32; i++, b += 18) {
        const uint8_t *q = b + 2;
        const int8_t *xq = x.q + 32 * i;
#ifdef __AVX2__
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nibble_dot8(table, q, xq)),
                               _mm256_set1_ps(f16(b) * x.d[i >> x.sh]), vacc);
#else
        acc += f16(b) * x.d[i >> x.sh] * (float)nibble_dot(iq4nl_values, q, xq);
#endif
    }
#ifdef __AVX2__
    acc += hsum8(vacc);
#endif
    return acc;
}

#ifdef __AVX2__
/* +1 or -1 for 32 values from 4 sign bytes (byte l's bits for values 8 l .. 8 l + 7) */
static inline __m256i signs32(uint32_t four) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)four), spread);
    __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
    return _mm256_or_si256(neg, _mm256_set1_epi8(1));
}

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
#endif

#ifdef __AVX2__
/* int16 scales: a for the first 16 values of a run of 32, b for the last 16 */
static inline __m256i halves16(int a, int b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)a)),
                                   _mm_set1_epi16((short)b), 1);
}

/* 32 magnitudes (four rows of 8 of a grid) times x's 32 int8 values signed by 32 sign bits,
 * each half of 16 scaled by its int16 scale, as 8 int32 sums */
static inline __m256i grid_dot(__m256i mag, uint32_t four, const int8_t *xq, __m256i sc) {
    __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xq), signs32(four));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xv), sc);
}
#endif

/* two rows of 4 of a grid as one of 8 */
typedef struct { uint8_t v[8]; } eight_t;
static inline eight_t grid8(const uint8_t *a, const uint8_t *b) {
    eight_t e;
    memcpy(e.v, a, 4);
    memcpy(e.v + 4, b, 4);
    return e;
}

/* the scalar product of 8 grid magnitudes with 8 values of x, each sign bit j negating one */
static inline int32_t signed8(const uint8_t *g, int sg, const int8_t *xl) {
    int32_t s = 0;
    for (int j = 0; j < 8; j++)
        s += ((sg >> j) & 1 ? -(int32_t)g[j] : (int32_t)g[j]) * xl[j];
    return s;
}

/* the sign bytes of a run's four 7-bit sign indices (IQ2_XXS, IQ3_XXS; IQ2_XS's
 * from its words' top 7 bits), byte l for the
 * values 8 l .. 8 l + 7 */
static inline uint32_t sign_bytes(uint32_t aux) {
    uint32_t four = 0;
    for (int l = 0; l < 4; l++)
        four |= (uint32_t)ksigns[(aux >> (7 * l)) & 127] << (8 * l);
    return four;
}

/* a grid type's integer sums over a block: a vector of 8 under AVX2, else one int */
#ifdef __AVX2__
typedef __m256i isum_t;
#define ISUM_ZERO _mm256_setzero_si256()
#define ISUM_TOTAL(a) hsum_i32(a)
#else
typedef int32_t isum_t;
#define ISUM_ZERO 0
#define ISUM_TOTAL(a) (a)
#endif

#ifdef __AVX2__
/* four rows of 8 bytes, row l in the vector's 64-bit lane l */
static inline __m256i gather8(const uint8_t *const r[4]) {
    return _mm256_set_epi64x((long long)ld64(r[3]), (long long)ld64(r[2]),
                             (long long)ld64(r[1]), (long long)ld64(r[0]));
}
#endif

/* a run of 32 values of x against four grid rows of 8 magnitudes (r), signed by the bits of
 * ``four`` (row l's in byte l), rows 0-1 scaled by s0 and rows 2-3 by s1: IQ2_XXS / IQ2_XS /
 * IQ2_S */
static inline isum_t rows8_dot(isum_t acc, const uint8_t *const r[4], uint32_t four, int s0,
                               int s1, const int8_t *xq) {
#ifdef __AVX2__
    return _mm256_add_epi32(acc, grid_dot(gather8(r), four, xq, halves16(s0, s1)));
#else
    for (int l = 0; l < 4; l++)
        acc += (l < 2 ? s0 : s1) * signed8(r[l], (four >> (8 * l)) & 255, xq + 8 * l);
    return acc;
#endif
}

/* the same against eight grid rows of 4 magnitudes, one scale: IQ3_XXS / IQ3_S */
static inline isum_t rows4_dot(isum_t acc, const uint8_t *const r[8], uint32_t four, int scale,
                               const int8_t *xq) {
#ifdef __AVX2__
    __m256i mag = _mm256_setr_epi32(
        (int)ld32(r[0]), (int)ld32(r[1]), (int)ld32(r[2]), (int)ld32(r[3]),
        (int)ld32(r[4]), (int)ld32(r[5]), (int)ld32(r[6]), (int)ld32(r[7]));
    return _mm256_add_epi32(acc, grid_dot(mag, four, xq, _mm256_set1_epi16((short)scale)));
#else
    for (int l = 0; l < 4; l++)
        acc += scale * signed8(grid8(r[2 * l], r[2 * l + 1]).v, (four >> (8 * l)) & 255,
                               xq + 8 * l);
    return acc;
#endif
}

/* IQ2_XXS (66 bytes per 256): d, then per 32 values two words: 4 grid indices (8 magnitudes
 * each) and 4 seven-bit sign indices with a 4-bit scale s on top (the run's scale d (2s+1)/8) */
static float dot_iq2_xxs(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 66) {
        isum_t isum = ISUM_ZERO;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *w = b + 2 + 8 * ib;
            uint32_t aux = le32(w + 4);
            int scale = 2 * (int)(aux >> 28) + 1;
            const uint8_t *r[4] = {iq2xxs_grid[w[0]], iq2xxs_grid[w[1]], iq2xxs_grid[w[2]],
                                   iq2xxs_grid[w[3]]};
            isum = rows8_dot(isum, r, sign_bytes(aux), scale, scale, x.q + 256 * i + 32 * ib);
        }
        acc += x.d[i] * f16(b) * 0.125f * (float)ISUM_TOTAL(isum);
    }
    return acc;
}

/* IQ3_XXS (98 bytes per 256): d, 64 grid indices (4 magnitudes each), then per 32 values a
 * word of 4 seven-bit sign indices (one per 8 values) with a 4-bit scale s on top (the run's
 * scale d (2s+1)/4) */
static float dot_iq3_xxs(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 98) {
        const uint8_t *q = b + 2;
        isum_t isum = ISUM_ZERO;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux = le32(b + 66 + 4 * ib);
            const uint8_t *r[8];
            for (int k = 0; k < 8; k++)
                r[k] = iq3xxs_grid[q[8 * ib + k]];
            isum = rows4_dot(isum, r, sign_bytes(aux), 2 * (int)(aux >> 28) + 1,
                             x.q + 256 * i + 32 * ib);
        }
        acc += x.d[i] * f16(b) * 0.25f * (float)ISUM_TOTAL(isum);
    }
    return acc;
}

/* IQ2_XS (74 bytes per 256): d, 32 16-bit words (a 9-bit index into a 512 x 8 grid, a 7-bit
 * sign index), then 8 bytes of two 4-bit scales s, one per 16 values (scale d (2s+1)/8) */
static float dot_iq2_xs(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 74) {
        const uint8_t *sc = b + 66;
        isum_t isum = ISUM_ZERO;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *r[4];
            uint32_t four = 0;
            for (int l = 0; l < 4; l++) {
                const uint8_t *w = b + 2 + 8 * ib + 2 * l;
                uint32_t q = (uint32_t)w[0] | ((uint32_t)w[1] << 8);
                r[l] = iq2xs_grid[q & 511];
                four |= (uint32_t)ksigns[q >> 9] << (8 * l);
            }
            isum = rows8_dot(isum, r, four, 2 * (sc[ib] & 15) + 1, 2 * (sc[ib] >> 4) + 1,
                             x.q + 256 * i + 32 * ib);
        }
        acc += x.d[i] * f16(b) * 0.125f * (float)ISUM_TOTAL(isum);
    }
    return acc;
}

/* IQ2_S (82 bytes per 256): d, 32 low bytes of 10-bit indices into a 1024 x 8 grid, 32 sign
 * bytes (one per 8 values), 8 bytes of the indices' high 2 bits (four per byte), then 8
 * bytes of two 4-bit scales s, one per 16 values (scale d (2s+1)/8) */
static float dot_iq2_s(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 82) {
        const uint8_t *qs = b + 2, *sg = b + 34, *qh = b + 66, *sc = b + 74;
        isum_t isum = ISUM_ZERO;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *r[4];
            for (int l = 0; l < 4; l++)
                r[l] = iq2s_grid[qs[4 * ib + l] | (((qh[ib] >> (2 * l)) & 3) << 8)];
            isum = rows8_dot(isum, r, le32(sg + 4 * ib), 2 * (sc[ib] & 15) + 1,
                             2 * (sc[ib] >> 4) + 1, x.q + 256 * i + 32 * ib);
        }
        acc += x.d[i] * f16(b) * 0.125f * (float)ISUM_TOTAL(isum);
    }
    return acc;
}

/* IQ3_S (110 bytes per 256): d, 64 low bytes of 9-bit indices into a 512 x 4 grid, 8 bytes of
 * the indices' high bits (eight per byte), 32 sign bytes (one per 8 values), then 4 bytes of
 * two 4-bit scales s, one per 32 values (scale d (2s+1)) */
static float dot_iq3_s(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 110) {
        const uint8_t *qs = b + 2, *qh = b + 66, *sg = b + 74, *sc = b + 106;
        isum_t isum = ISUM_ZERO;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *r[8];
            for (int k = 0; k < 8; k++)
                r[k] = iq3s_grid[qs[8 * ib + k] | (((qh[ib] >> k) & 1) << 8)];
            int scale = 2 * ((sc[ib / 2] >> (4 * (ib & 1))) & 15) + 1;
            isum = rows4_dot(isum, r, le32(sg + 4 * ib), scale, x.q + 256 * i + 32 * ib);
        }
        acc += x.d[i] * f16(b) * (float)ISUM_TOTAL(isum);
    }
    return acc;
}

/* IQ1_S and IQ1_M: per 8 values a grid row g of -1, 0, 1 (held as g + 1) and a shift of
 * +-1/8, w = d (2s+1) (g +- 1/8). In integers, 8 w / (d (2s+1)) = 8 (g + 1) - 8 +- 1, so a run
 * of 8 contributes (2s+1) (8 P + (+-1 - 8) S), P its sum of (g + 1) x and S its sum of x. */
#ifdef __AVX2__
/* 32 values: cp the int16 8 (2s+1) and cs the int16 (2s+1) (+-1 - 8) of each pair of values */
static inline __m256i iq1_dot(__m256i mag, const int8_t *xq, __m256i cp, __m256i cs) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(mag, xv), cp),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), xv), cs));
}

static inline __m256i iq1_rows(const int idx[4]) {
    const uint8_t *const r[4] = {iq1_grid[idx[0]], iq1_grid[idx[1]], iq1_grid[idx[2]],
                                 iq1_grid[idx[3]]};
    return gather8(r);
}
#endif

/* one run of 8, scalar: sum of (8 (g + 1) - 8 + shift) x */
static inline int32_t iq1_run(int idx, int shift, const int8_t *xl) {
    int32_t s = 0;
    for (int j = 0; j < 8; j++)
        s += (8 * (int32_t)iq1_grid[idx][j] - 8 + shift) * xl[j];
    return s;
}

/* IQ1_S (50 bytes per 256): d, 32 low bytes of 11-bit grid indices, then per 32 values a
 * 16-bit word: the indices' high 3 bits (x4), a 3-bit scale s and the shift's sign on top */
static float dot_iq1_s(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 50) {
        const int8_t *xq = x.q + 256 * i;
        int32_t isum = 0;
#ifdef __AVX2__
        __m256i iacc = _mm256_setzero_si256();
#endif
        for (int ib = 0; ib < 8; ib++) {
            uint32_t qh = (uint32_t)b[34 + 2 * ib] | ((uint32_t)b[35 + 2 * ib] << 8);
            int32_t scale = 2 * ((qh >> 12) & 7) + 1, shift = qh & 0x8000 ? -1 : 1;
            int idx[4];
            for (int l = 0; l < 4; l++)
                idx[l] = b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8);
#ifdef __AVX2__
            iacc = _mm256_add_epi32(iacc, iq1_dot(iq1_rows(idx), xq + 32 * ib,
                                                  _mm256_set1_epi16((short)(8 * scale)),
                                                  _mm256_set1_epi16((short)(scale * (shift - 8)))));
#else
            for (int l = 0; l < 4; l++)
                isum += scale * iq1_run(idx[l], shift, xq + 32 * ib + 8 * l);
#endif
        }
#ifdef __AVX2__
        isum = hsum_i32(iacc);
#endif
        acc += x.d[i] * f16(b) * 0.125f * (float)isum;
    }
    return acc;
}

/* IQ1_M (56 bytes per 256): 32 low bytes of 11-bit grid indices, 16 bytes of two nibbles (an
 * index's high 3 bits and its run's shift sign), then four 16-bit words of four 3-bit scales
 * s (one per 16 values) whose top nibbles make the block's f16 d */
static float dot_iq1_m(const uint8_t *b, qx_t x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n / 256; i++, b += 56) {
        const int8_t *xq = x.q + 256 * i;
        const uint8_t *qh = b + 32;
        uint16_t sc[4];
        memcpy(sc, b + 48, 8);  /* little-endian words, as x86 reads them */
        uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) |
                                    ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000));
        uint8_t d16[2] = {(uint8_t)(dbits & 0xFF), (uint8_t)(dbits >> 8)};
        int32_t isum = 0;
#ifdef __AVX2__
        __m256i iacc = _mm256_setzero_si256();
#endif
        for (int ib = 0; ib < 8; ib++) {
            /* four nibbles (an index's high 3 bits, its shift's sign) and two scales */
            uint32_t h = (uint32_t)qh[2 * ib] | ((uint32_t)qh[2 * ib + 1] << 8);
            uint32_t sw = (uint32_t)sc[ib >> 1] >> (6 * (ib & 1));
            int32_t s0 = 2 * (int32_t)(sw & 7) + 1, s1 = 2 * (int32_t)((sw >> 3) & 7) + 1;
            int idx[4];
            for (int l = 0; l < 4; l++)
                idx[l] = b[4 * ib + l] | (((h >> (4 * l)) & 7) << 8);
#define IQ1M_SHIFT(l) ((h >> (4 * (l) + 3)) & 1 ? -1 : 1)
#ifdef __AVX2__
            /* a run of 8 is 4 int16 pairs: its coefficient 4 times */
            const uint64_t rep = 0x0001000100010001ULL;
            __m256i cs = _mm256_setr_epi64x(
                (long long)((uint64_t)(uint16_t)(s0 * (IQ1M_SHIFT(0) - 8)) * rep),
                (long long)((uint64_t)(uint16_t)(s0 * (IQ1M_SHIFT(1) - 8)) * rep),
                (long long)((uint64_t)(uint16_t)(s1 * (IQ1M_SHIFT(2) - 8)) * rep),
                (long long)((uint64_t)(uint16_t)(s1 * (IQ1M_SHIFT(3) - 8)) * rep));
            iacc = _mm256_add_epi32(iacc, iq1_dot(iq1_rows(idx), xq + 32 * ib,
                                                  halves16(8 * s0, 8 * s1), cs));
#else
            for (int l = 0; l < 4; l++)
                isum += (l < 2 ? s0 : s1) * iq1_run(idx[l], IQ1M_SHIFT(l), xq + 32 * ib + 8 * l);
#endif
#undef IQ1M_SHIFT
        }
#ifdef __AVX2__
        isum = hsum_i32(iacc);
#endif
        acc += x.d[i] * f16(d16) * 0.125f * (float)isum;
    }
    return acc;
}

static size_t row_bytes(int type, int n) {
    switch (type) {
    case T_Q4_K: return (size_t)n / 256 * 144;
    case T_Q5_K: return (size_t)n / 256 * 176;
    case T_Q6_K: return (size_t)n / 256 * 210;
    case T_Q8_0: return (size_t)n / 32 * 34;
    case T_Q4_0: return (size_t)n / 32 * 18;
    case T_Q4_1: return (size_t)n / 32 * 20;
    case T_Q5_0: return (size_t)n / 32 * 22;
    case T_Q5_1: return (size_t)n / 32 * 24;
    case T_Q2_K: return (size_t)n / 256 * 84;
    case T_Q3_K: return (size_t)n / 256 * 110;
    case T_IQ4_XS: return iq4nl_set ? (size_t)n / 256 * 136 : 0;
    case T_IQ2_XXS: return iq2xxs_set ? (size_t)n / 256 * 66 : 0;
    case T_IQ3_XXS: return iq3xxs_set ? (size_t)n / 256 * 98 : 0;
    case T_IQ2_XS: return iq2xs_set ? (size_t)n / 256 * 74 : 0;
    case T_IQ2_S: return iq2s_set ? (size_t)n / 256 * 82 : 0;
    case T_IQ3_S: return iq3s_set ? (size_t)n / 256 * 110 : 0;
    case T_IQ1_S: return iq1_set ? (size_t)n / 256 * 50 : 0;
    case T_IQ1_M: return iq1_set ? (size_t)n / 256 * 56 : 0;
    case T_IQ4_NL: return iq4nl_set ? (size_t)n / 32 * 18 : 0;
    case T_MXFP4: return mxfp4_set ? (size_t)n / 32 * 17 : 0;
    default: return 0;
    }
}

static float dot(int type, const uint8_t *b, qx_t x, int n) {
    switch (type) {
    case T_Q4_K: return dot_q4_k(b, x, n);
    case T_Q5_K: return dot_q5_k(b, x, n);
    case T_Q6_K: return dot_q6_k(b, x, n);
    case T_Q4_0: return dot_q4_q5(b, x, n, 4, 0);
    case T_Q4_1: return dot_q4_q5(b, x, n, 4, 1);
    case T_Q5_0: return dot_q4_q5(b, x, n, 5, 0);
    case T_Q5_1: return dot_q4_q5(b, x, n, 5, 1);
    case T_MXFP4: return dot_mxfp4(b, x, n);
    case T_Q2_K: return dot_q2_k(b, x, n);
    case T_Q3_K: return dot_q3_k(b, x, n);
    case T_IQ4_XS: return dot_iq4_xs(b, x, n);
    case T_IQ4_NL: return dot_iq4_nl(b, x, n);
    case T_IQ2_XXS: return dot_iq2_xxs(b, x, n);
    case T_IQ3_XXS: return dot_iq3_xxs(b, x, n);
    case T_IQ2_XS: return dot_iq2_xs(b, x, n);
    case T_IQ2_S: return dot_iq2_s(b, x, n);
    case T_IQ3_S: return dot_iq3_s(b, x, n);
    case T_IQ1_S: return dot_iq1_s(b, x, n);
    case T_IQ1_M: return dot_iq1_m(b, x, n);
    default: return dot_q8_0(b, x, n);
    }
}

/* the values per scale of x: 32 where every type has blocks of 32, else 256 (the K-quants'
 * super-blocks) */
static int group(int gate_type, int up_type, int down_type) {
    int small = 1, t[3] = {gate_type, up_type, down_type};
    for (int i = 0; i < 3; i++)
        small &= t[i] == T_Q8_0 || t[i] == T_MXFP4 || t[i] == T_IQ4_NL || t[i] == T_Q4_0 ||
                 t[i] == T_Q4_1 || t[i] == T_Q5_0 || t[i] == T_Q5_1;
    return small ? 32 : 256;
}

static int block_ok(int type, int n, int g) {
    return row_bytes(type, n) != 0 && n % g == 0;
}

/* a vector of n values quantized, in scratch: its int8 values, its per-32 or per-256 scales
 * (room for per-32), then its per-16 and per-32 integer sums (int16) */
static size_t qx_bytes(int n) {
    return (size_t)n + (size_t)n / 32 * 4 + (size_t)n / 16 * 2 + (size_t)n / 32 * 2;
}

static qx_t qx_at(uint8_t *p, int n, int g) {
    qx_t x = {(const int8_t *)p, (const float *)(p + n), (const int16_t *)(p + n + n / 8),
              (const int16_t *)(p + n + n / 4), g, g == 256 ? 3 : 0};
    return x;
}

static void qx_fill(uint8_t *p, const float *v, int n, int g) {
    quantize(v, n, g, (int8_t *)p, (float *)(p + n), (int16_t *)(p + n + n / 8),
             (int16_t *)(p + n + n / 4));
}

/* The scratch bytes carve_experts needs for k experts (aligned to 64 per part). */
size_t carve_scratch_bytes(int n_embd, int n_ff, int k) {
    size_t a = (qx_bytes(n_embd) + 63) / 64 * 64, h = ((size_t)k * n_ff * 4 + 63) / 64 * 64;
    size_t hq = ((qx_bytes(n_ff) + 63) / 64 * 64) * (size_t)k;
    return a + h + hq;
}

/* One layer's experts as the kernel reads them (gate, up, down: [n_expert][rows] rows of
 * blocks of their types; biases or NULL), with its scratch. */
typedef struct {
    int n_embd, n_ff, n_expert, act;
    float limit;
    const uint8_t *gate, *up, *down;
    int gate_type, up_type, down_type;
    const float *gate_b, *up_b, *down_b;
    uint8_t *scratch;
} layer_t;

static int layer_ok(const layer_t *L) {
    int g = group(L->gate_type, L->up_type, L->down_type);
    return block_ok(L->gate_type, L->n_embd, g) && block_ok(L->up_type, L->n_embd, g) &&
           block_ok(L->down_type, L->n_ff, g) && L->act >= 0 && L->act <= 2;
}

static int ids_ok(const layer_t *L, int c, const int32_t *ids) {
    for (int j = 0; j < c; j++)
        if (ids[j] < 0 || ids[j] >= L->n_expert)
            return 0;
    return 1;
}

/* x quantized into the scratch's head, where `experts_in_region` reads it */
static void layer_take_x(const layer_t *L, const float *x) {
    qx_fill(L->scratch, x, L->n_embd, group(L->gate_type, L->up_type, L->down_type));
}

/* y = the c experts' weighted sum of the x `layer_take_x` quantized, called by every thread
 * of an OpenMP region (its loops shared among them, each ending in a barrier) */
static void experts_in_region(const layer_t *L, int c, const int32_t *ids, const float *w,
                              float *y) {
    const int n_embd = L->n_embd, n_ff = L->n_ff, act = L->act;
    const int g = group(L->gate_type, L->up_type, L->down_type);
    const size_t gr = row_bytes(L->gate_type, n_embd), ur = row_bytes(L->up_type, n_embd);
    const size_t dr = row_bytes(L->down_type, n_ff);
    const size_t xb = (qx_bytes(n_embd) + 63) / 64 * 64, hqb = (qx_bytes(n_ff) + 63) / 64 * 64;
    uint8_t *hqp = L->scratch + xb + ((size_t)c * n_ff * 4 + 63) / 64 * 64;
    float *h = (float *)(L->scratch + xb);
    const qx_t xq = qx_at(L->scratch, n_embd, g);
#pragma omp for schedule(static)
    for (long i = 0; i < (long)c * n_ff; i++) {
        long j = i / n_ff, r = i % n_ff, e = ids[j];
        const uint8_t *gb = L->gate + ((size_t)e * n_ff + r) * gr;
        const uint8_t *ub = L->up + ((size_t)e * n_ff + r) * ur;
        float a = dot(L->gate_type, gb, xq, n_embd), u = dot(L->up_type, ub, xq, n_embd);
        if (L->gate_b) {
            a += L->gate_b[(size_t)e * n_ff + r];
            u += L->up_b[(size_t)e * n_ff + r];
        }
        if (act == 0) {
            a = a / (1.0f + expf(-a));
        } else if (act == 1) {
            a = 0.5f * a * (1.0f + tanhf(0.7978845608f * (a + 0.044715f * a * a * a)));
        } else {
            a = fminf(a, L->limit);
            u = fminf(fmaxf(u, -L->limit), L->limit) + 1.0f;
            a = a / (1.0f + expf(-1.702f * a));
        }
        h[i] = a * u;
    }
#pragma omp for schedule(static)
    for (long j = 0; j < c; j++)
        qx_fill(hqp + j * hqb, h + j * n_ff, n_ff, g);
#pragma omp for schedule(static)
    for (long r = 0; r < n_embd; r++) {
        float s = 0.0f;
        for (long j = 0; j < c; j++) {
            const uint8_t *db = L->down + ((size_t)ids[j] * n_embd + r) * dr;
            float v = dot(L->down_type, db, qx_at(hqp + j * hqb, n_ff, g), n_ff);
            s += w[j] * (L->down_b ? v + L->down_b[(size_t)ids[j] * n_embd + r] : v);
        }
        y[r] = s;
    }
}

/* Returns 0; -1 where a type or size is not one this file multiplies, -2 where an id is not
 * below n_expert (nothing written either way). act: 0 SiLU, 1 tanh GELU, 2 gpt-oss's SwiGLU
 * (gate clamped to <= limit, up to [-limit, limit], gate * sigmoid(1.702 gate) * (up + 1)).
 * gate_b, up_b [n_expert][n_ff] and down_b [n_expert][n_embd]: biases added to each expert's
 * products, or NULL. scratch: at least carve_scratch_bytes(n_embd, n_ff, c), 64-byte
 * aligned. threads: the OpenMP threads. */
int carve_experts(int n_embd, int n_ff, int n_expert, int c, const float *x,
                  const int32_t *ids, const float *w, const uint8_t *gate, int gate_type,
                  const uint8_t *up, int up_type, const uint8_t *down, int down_type, int act,
                  float limit, const float *gate_b, const float *up_b, const float *down_b,
                  uint8_t *scratch, float *y, int threads) {
    const layer_t L = {n_embd, n_ff, n_expert, act, limit, gate, up, down, gate_type, up_type,
                       down_type, gate_b, up_b, down_b, scratch};
    if (!layer_ok(&L) || c < 0)
        return -1;
    if (!ids_ok(&L, c, ids))
        return -2;
    layer_take_x(&L, x);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    experts_in_region(&L, c, ids, w, y);
    return 0;
}

/* ---- a decode step's split layers answered in turn (carve_kernels/host_split.py) ----
 *
 * For each layer the GPU publishes, in pinned host memory, the normed row x, the CPU's c
 * ids and weights, then a ticket (flags[0] = flags[1] + 1); the host computes those experts'
 * weighted sum into y and answers (flags[1] = flags[0]); the GPU spins on the answer, then
 * adds y. carve_serve answers a step's layers in order inside one OpenMP region, every
 * thread spinning on the ticket itself between layers: no thread sleeps in a barrier or
 * wakes from one while the GPU runs the layers between, and no interpreter runs between a
 * ticket and its answer. */
typedef struct {
    int32_t *flags;     /* [0] the GPU's ticket, [1] the host's answer (the stage's words) */
    const void *x;      /* the published row: n_embd values of x_type */
    int x_type;         /* 0 float32, 1 float16, 2 bfloat16 */
    const int32_t *ids; /* the CPU's share of the routing: c ids and their weights */
    const float *w;
    float *y;           /* n_embd float32: the answer's sum */
    float *xf;          /* n_embd float32 of room: x as float */
    int c;
    int n_embd, n_ff, n_expert, act;
    float limit;
    const uint8_t *gate, *up, *down;
    int gate_type, up_type, down_type;
    const float *gate_b, *up_b, *down_b;
    uint8_t *scratch;
} carve_serve_layer;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void row_to_float(const carve_serve_layer *S) {
    const uint8_t *b = (const uint8_t *)S->x;
    for (int i = 0; i < S->n_embd; i++) {
        if (S->x_type == 0) {
            memcpy(S->xf + i, b + 4 * i, 4);
        } else if (S->x_type == 1) {
            S->xf[i] = f16(b + 2 * i);
        } else {
            uint32_t u = (uint32_t)(b[2 * i] | (b[2 * i + 1] << 8)) << 16;
            memcpy(S->xf + i, &u, 4);
        }
    }
}

static layer_t layer_of(const carve_serve_layer *S) {
    const layer_t L = {S->n_embd, S->n_ff, S->n_expert, S->act, S->limit, S->gate, S->up,
                       S->down, S->gate_type, S->up_type, S->down_type, S->gate_b, S->up_b,
                       S->down_b, S->scratch};
    return L;
}

/* Answer n layers' tickets in order. times: n pairs (seconds waited for the ticket, seconds
 * computing), added to. Returns 0; -1 where a layer's types or sizes are refused (before any
 * answer); -2 where a layer's ids are out of range (that ticket answered, its sum NaN); -3
 * where no ticket came within timeout_s. *failed: the layer that stopped it. Tickets after it
 * are left to the caller (engine/runtime/gpu/stage_graph.py drains them). */
int carve_serve(const carve_serve_layer *layers, int n, int threads, double timeout_s,
                double *times, int *failed) {
    for (int i = 0; i < n; i++) {
        layer_t L = layer_of(layers + i);
        if (!layer_ok(&L) || layers[i].c < 1 || layers[i].x_type < 0 || layers[i].x_type > 2) {
            *failed = i;
            return -1;
        }
    }
    if (n < 1)
        return 0;
    int stop = 0, rc = 0;
    double mark = now_s();
    const int32_t start = __atomic_load_n(&layers[0].flags[1], __ATOMIC_ACQUIRE);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        int32_t seen = start;
        for (int i = 0; i < n; i++) {
            const carve_serve_layer *S = layers + i;
            const layer_t L = layer_of(S);
            const int lead = omp_get_thread_num() == 0;
            const double since = lead ? now_s() : 0.0;
            long spins = 0;
            while (__atomic_load_n(&S->flags[0], __ATOMIC_ACQUIRE) == seen &&
                   !__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
                cpu_relax();
                if (lead && (++spins & 1023) == 0 && now_s() - since > timeout_s) {
                    rc = -3, *failed = i;
                    __atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
                }
            }
#pragma omp barrier
            if (__atomic_load_n(&stop, __ATOMIC_RELAXED))
                break;
            seen = __atomic_load_n(&S->flags[0], __ATOMIC_ACQUIRE);
            int ok;
#pragma omp single copyprivate(ok)
            {
                double t = now_s();
                times[2 * i] += t - mark;
                mark = t;
                ok = ids_ok(&L, S->c, S->ids);
                if (ok) {
                    row_to_float(S);
                    layer_take_x(&L, S->xf);
                }
            }
            if (ok)
                experts_in_region(&L, S->c, S->ids, S->w, S->y);
#pragma omp single
            {
                if (!ok) {
                    for (int r = 0; r < S->n_embd; r++)
                        S->y[r] = NAN;
                    rc = -2, *failed = i;
                    __atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
                }
                __atomic_store_n(&S->flags[1], seen, __ATOMIC_RELEASE);
                double t = now_s();
                times[2 * i + 1] += t - mark;
                mark = t;
            }
            if (__atomic_load_n(&stop, __ATOMIC_RELAXED))
                break;
        }
    }
    return rc;
}
