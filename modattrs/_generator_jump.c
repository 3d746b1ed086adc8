/* Jumping torch's CPU generator (MT19937) ahead, compiled: the two loops of modattrs/_deferred/rng/mt19937.py's jumps.
 *
 * mt19937_power_of_x(exponent, modulus) computes x^exponent mod p over GF(2) by squaring (and multiplying by x) one
 * bit of the exponent at a time; mt19937_twisted(array, coefficients) turns the engine's array into the array after
 * the twists that x^M mod p = sum c_j x^j stands for: w[M + i] = XOR_j c_j w[j + i], i = 1 .. 624, from the
 * untempered words w[0 .. 20560] the array starts. Polynomials are bit-packed little-endian (coefficient j is bit
 * j % 8 of byte j / 8), as Python's int.to_bytes(n, "little") packs them. mt19937.py does the same in torch when
 * this extension is not built, with the same results. Both release the GIL: jumps in several threads run at once.
 *
 * mt19937_twisted has two methods that give the same bytes: "words", portable, and "clmul128", carry-less
 * multiplication (PCLMULQDQ, x86-64 CPUs since 2010), chosen at run time by the CPU's features. mt19937_methods()
 * names those this CPU and build support, best last, and an optional last argument forces one (tests compare them;
 * mt19937.py checks "clmul128" against "words" at its first use in a process). Only methods with a gain measured on
 * a replay are kept (docs/benchmarks.rst, "Jumping the generator", has the figures and the reasons): wider vectors
 * for either loop gained less there than the measure's noise (AVX2) or could not be measured (AVX-512).
 *
 * The module is optional, as modattrs/_speedups.c is: pip builds it when a C compiler is there, and without it
 * mt19937.py jumps with torch's FFTs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MT_N 624
#define MT_DEGREE 19937                         /* of p: the state's bits */
#define MT_STREAM (MT_DEGREE + MT_N)            /* untempered words w[0 .. 20560] */
#define MT_POLY_BYTES ((MT_DEGREE + 1 + 7) / 8) /* 2,493: p, or a polynomial of degree below 19,937 */
#define MT_WORDS 312                            /* 64-bit words of a polynomial of degree below 19,937 */
#define MT_SPAN 8                               /* words reduced at once: 512 bits, less than p's gap (checked) */
#define MT_CHUNKS (MT_WORDS / MT_SPAN)          /* 39 */
#define MT_PAD 10                               /* zero words on either side of the quotient, read past its ends */

/* x86-64: the carry-less method of mt19937_twisted, chosen at run time */
#if defined(__x86_64__) &&                                                                                             \
    ((defined(__clang__) && __clang_major__ >= 10) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8))
#define MT_X86 1
#include <immintrin.h>
#endif

/* The low 32 bits of x spread to the even bits: its square over GF(2). */
static inline uint64_t mt_spread(uint64_t x) {
    x &= 0xFFFFFFFFu;
    x = (x | (x << 16)) & 0x0000FFFF0000FFFFull;
    x = (x | (x << 8)) & 0x00FF00FF00FF00FFull;
    x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0Full;
    x = (x | (x << 2)) & 0x3333333333333333ull;
    return (x | (x << 1)) & 0x5555555555555555ull;
}

/* The degrees below 19,937 of the terms of a bit-packed polynomial (MT_POLY_BYTES bytes), in order; their count. */
static int mt_ones(const unsigned char *packed, uint16_t *positions) {
    int count = 0;
    for (int byte = 0; byte < MT_POLY_BYTES; byte++) {
        int j = 8 * byte;
        for (unsigned bits = packed[byte]; bits != 0; bits >>= 1, j++) {
            if ((bits & 1) && j < MT_DEGREE) {
                positions[count++] = (uint16_t)j;
            }
        }
    }
    return count;
}

/* p's terms below its degree, from `modulus`; their count, or -1 with ValueError set for a polynomial not of degree
 * 19,937 or whose terms below it come too close to it for mt_square_mod. */
static int mt_terms(const unsigned char *modulus, uint16_t *terms) {
    int count = mt_ones(modulus, terms);
    int leading = modulus[MT_DEGREE >> 3] >> (MT_DEGREE & 7);
    if (leading != 1 || (count > 0 && terms[count - 1] > MT_DEGREE - 64 * MT_SPAN)) {
        PyErr_SetString(PyExc_ValueError,
                        "mt19937_power_of_x: `modulus` is not MT19937's characteristic polynomial: expected "
                        "degree 19937 and no other term above degree 19425");
        return -1;
    }
    return count;
}

/* acc[l] ^= bits at + 64 l .. at + 64 l + 63 of the bit array src, l = 0 .. 7 (reads src[at / 64 .. at / 64 + 8]). */
static inline void mt_xor_bits(uint64_t *acc, const uint64_t *src, long at) {
    const uint64_t *s = src + (at >> 6);
    int shift = (int)(at & 63);
    for (int l = 0; l < MT_SPAN; l++) {
        acc[l] ^= (s[l] >> shift) | ((s[l + 1] << 1) << (63 - shift));
    }
}

typedef struct {
    uint64_t square[2 * MT_WORDS + 16]; /* a^2 x^digit, zeros above */
    uint64_t quotient[MT_PAD + MT_WORDS + MT_PAD];
    uint64_t power[MT_WORDS];
} mt_power_work;

/* a (degree below 19,937) becomes a^2 x^digit mod p. With S = a^2 x^digit = Q p + r: Q_i = S_(19937 + i) + sum over
 * p's terms e below its degree of Q_(i + 19937 - e), top down, 512 bits at a time (19937 - e >= 623: those bits are
 * done), then r_j = S_j + sum_e Q_(j - e). Each 512-bit piece is a sum of shifted reads held in registers: no two
 * writes meet, so the compiler may vectorize it. */
static void mt_square_mod(uint64_t *a, int digit, const uint16_t *terms, int count, mt_power_work *work) {
    uint64_t *square = work->square, *quotient = work->quotient + MT_PAD;
    for (int i = 0; i < MT_WORDS; i++) {
        square[2 * i] = mt_spread(a[i]);
        square[2 * i + 1] = mt_spread(a[i] >> 32);
    }
    square[2 * MT_WORDS] = 0;
    if (digit) {
        for (int i = 2 * MT_WORDS; i > 0; i--) {
            square[i] = (square[i] << 1) | (square[i - 1] >> 63);
        }
        square[0] <<= 1;
    }
    for (int chunk = MT_CHUNKS - 1; chunk >= 0; chunk--) {
        long low = (long)64 * MT_SPAN * chunk;
        uint64_t acc[MT_SPAN] = {0};
        mt_xor_bits(acc, square, MT_DEGREE + low);
        int t = 0;
        while (t < count && low + MT_DEGREE - terms[t] >= 64 * MT_WORDS) { /* reads above the quotient: zeros */
            t++;
        }
        for (; t < count; t++) {
            mt_xor_bits(acc, quotient, low + MT_DEGREE - terms[t]);
        }
        memcpy(quotient + MT_SPAN * chunk, acc, sizeof acc);
    }
    for (int chunk = 0; chunk < MT_CHUNKS; chunk++) {
        long low = (long)64 * MT_SPAN * chunk;
        uint64_t acc[MT_SPAN];
        memcpy(acc, square + MT_SPAN * chunk, sizeof acc);
        for (int t = 0; t < count && terms[t] < low + 64 * MT_SPAN; t++) { /* higher terms read below Q_0: zeros */
            mt_xor_bits(acc, quotient - MT_PAD, low - terms[t] + 64 * MT_PAD);
        }
        memcpy(a + MT_SPAN * chunk, acc, sizeof acc);
    }
    a[MT_WORDS - 1] &= ((uint64_t)1 << (MT_DEGREE - 64 * (MT_WORDS - 1))) - 1; /* S's bits from 19,937 on */
}

/* One squaring per bit of the big-endian `digits` from bit `from` on, times x for a 1 bit. */
static void mt_squarings(uint64_t *a, const unsigned char *digits, Py_ssize_t from, Py_ssize_t bits,
                         const uint16_t *terms, int count, mt_power_work *work) {
    for (Py_ssize_t bit = from; bit < bits; bit++) {
        mt_square_mod(a, digits[bit >> 3] >> (7 - (bit & 7)) & 1, terms, count, work);
    }
}

/* --- the correlation: out[t] = XOR over the ones j of c of w[j + 1 + t], t = 0 .. 623 --- */

/* The untempered words w[624 .. count - 1] from the array w[0 .. 623]: w[n] = w[n - 227] ^ twist(w[n - 624],
 * w[n - 623]), as torch's engine twists. */
static void mt_stream(uint32_t *w, int count) {
    for (int n = MT_N; n < count; n++) {
        uint32_t mixed = (w[n - MT_N] & 0x80000000u) | (w[n - MT_N + 1] & 0x7FFFFFFFu);
        w[n] = w[n - 227] ^ (mixed >> 1) ^ ((0u - (mixed & 1u)) & 0x9908B0DFu);
    }
}

/* "words": a tile of outputs at a time, whose XORs stay in registers while the rows w[j + 1 ..] stream past, about
 * 30 ns a row (16-byte vectors with GCC and Clang, a plain loop with other compilers): 0.27 ms for the 10,000 rows
 * of a typical power, but as little as the stream itself for the few rows of a short jump. */
#if defined(__GNUC__) || defined(__clang__)
typedef uint32_t mt_lanes4 __attribute__((vector_size(16), aligned(4))); /* aligned(4): rows start anywhere */
#define MT_TILE4 6                                                         /* vectors: 24 words, 26 tiles */

static void mt_correlate(const uint32_t *w, const uint16_t *ones, int count, uint32_t *out) {
    for (int first = 0; first < MT_N; first += 4 * MT_TILE4) {
        mt_lanes4 acc[MT_TILE4] = {{0}};
        for (int k = 0; k < count; k++) {
            const mt_lanes4 *row = (const mt_lanes4 *)(w + ones[k] + 1 + first);
            for (int i = 0; i < MT_TILE4; i++) {
                acc[i] ^= row[i];
            }
        }
        memcpy(out + first, acc, sizeof acc);
    }
}
#else
static void mt_correlate(const uint32_t *w, const uint16_t *ones, int count, uint32_t *out) {
    for (int first = 0; first < MT_N; first += 8) {
        uint32_t acc[8] = {0};
        for (int k = 0; k < count; k++) {
            const uint32_t *row = w + ones[k] + 1 + first;
            for (int t = 0; t < 8; t++) {
                acc[t] ^= row[t];
            }
        }
        memcpy(out + first, acc, sizeof acc);
    }
}
#endif

enum { MT_BY_WORDS, MT_BY_CLMUL128, MT_TWIST_METHODS };
static const char *const mt_twist_methods[MT_TWIST_METHODS] = {"words", "clmul128"};
/* Below this many ones, "words" costs less than the method (its stream, 5 us, and 30 ns a row against a fixed
 * cost): only powers of short jumps have so few. */
static const int mt_words_below[MT_TWIST_METHODS] = {0, 2000};

#define MT_ROWS 322 /* 64-bit words of a plane: bit i of row k is bit b of w[64 k + i - 16] (0 for n < 0) */
#define MT_HEAD 10  /* rows the array gives: n = -16 .. 623 */
#define MT_OUT 10   /* rows of results: bit i of row m is bit b of out[64 m + i] */
#define MT_D0 311   /* the first of the 11 sums i + k = d of products c'[i] P[k] that land in the results */
#define MT_DS 11

#ifdef MT_X86
/* The "clmul128" method, bit-sliced: bit b of out[t] is the parity of c AND bit plane b of w shifted by t + 1, which
 * is coefficient 19937 + t of the product of c reversed and the plane over GF(2): a middle product, 64 x 64 bits
 * per carry-less multiplication (PCLMULQDQ) against 32 bits per XOR above: 32 planes x 11 x 312 multiplications,
 * two planes at once. */

/* c' = c reversed and placed so that the results start a word: bit e of c' is c_(19951 - e) (19951 + 16 + 1 is
 * 64 * 312, the offset of out[0] in the product). */
static inline uint64_t mt_bit_reversed(uint64_t x) {
    x = ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
    x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
    x = ((x >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((x & 0x0F0F0F0F0F0F0F0Full) << 4);
    return __builtin_bswap64(x);
}

static void mt_reversed(const unsigned char *c, uint64_t *reversed) {
    uint64_t words[MT_WORDS + 1] = {0}, flipped[MT_WORDS + 1];
    memcpy(words, c, MT_POLY_BYTES);
    words[MT_WORDS - 1] &= ((uint64_t)1 << (MT_DEGREE - 64 * (MT_WORDS - 1))) - 1; /* degrees 19,937 and up */
    for (int i = 0; i < MT_WORDS; i++) {
        flipped[i] = mt_bit_reversed(words[MT_WORDS - 1 - i]); /* bit e: c_(19967 - e) */
    }
    flipped[MT_WORDS] = 0;
    for (int i = 0; i < MT_WORDS; i++) {
        reversed[i] = (flipped[i] >> 16) | (flipped[i + 1] << 48);
    }
}

/* Rows 0 .. 9 of the planes (P[32 k + b]: row k of plane b) from the array: 16 words at a time, their bytes
 * gathered by place in the word, the bits of each read off by movemask from the top. */
__attribute__((target("ssse3"))) static void mt_head_planes(const uint32_t *w, uint64_t *P) {
    const __m128i gather = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    memset(P, 0, MT_HEAD * 32 * sizeof(uint64_t));
    for (int group = 1; group < 4 * MT_HEAD; group++) { /* w[16 (group - 1) ..]: group 0 is n < 0 */
        const __m128i *src = (const __m128i *)(w + 16 * (group - 1));
        __m128i r0 = _mm_shuffle_epi8(_mm_loadu_si128(src), gather);
        __m128i r1 = _mm_shuffle_epi8(_mm_loadu_si128(src + 1), gather);
        __m128i r2 = _mm_shuffle_epi8(_mm_loadu_si128(src + 2), gather);
        __m128i r3 = _mm_shuffle_epi8(_mm_loadu_si128(src + 3), gather);
        __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpackhi_epi32(r0, r1);
        __m128i t2 = _mm_unpacklo_epi32(r2, r3), t3 = _mm_unpackhi_epi32(r2, r3);
        __m128i bytes[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2), _mm_unpacklo_epi64(t1, t3),
                            _mm_unpackhi_epi64(t1, t3)}; /* byte y of each of the 16 words */
        unsigned char *row = (unsigned char *)(P + 32 * (group / 4)) + 2 * (group % 4);
        for (int y = 0; y < 4; y++) {
            __m128i v = bytes[y];
            for (int bit = 7; bit >= 0; bit--) {
                uint16_t mask = (uint16_t)_mm_movemask_epi8(v);
                memcpy(row + 8 * (8 * y + bit), &mask, 2);
                v = _mm_add_epi8(v, v);
            }
        }
    }
}

static const uint64_t mt_twist_mask[32] = { /* all ones for the bits MATRIX_A has */
#define MT_TWIST_BIT(b) ((0x9908B0DFu >> (b)) & 1u ? ~(uint64_t)0 : 0)
    MT_TWIST_BIT(0),  MT_TWIST_BIT(1),  MT_TWIST_BIT(2),  MT_TWIST_BIT(3),  MT_TWIST_BIT(4),  MT_TWIST_BIT(5),
    MT_TWIST_BIT(6),  MT_TWIST_BIT(7),  MT_TWIST_BIT(8),  MT_TWIST_BIT(9),  MT_TWIST_BIT(10), MT_TWIST_BIT(11),
    MT_TWIST_BIT(12), MT_TWIST_BIT(13), MT_TWIST_BIT(14), MT_TWIST_BIT(15), MT_TWIST_BIT(16), MT_TWIST_BIT(17),
    MT_TWIST_BIT(18), MT_TWIST_BIT(19), MT_TWIST_BIT(20), MT_TWIST_BIT(21), MT_TWIST_BIT(22), MT_TWIST_BIT(23),
    MT_TWIST_BIT(24), MT_TWIST_BIT(25), MT_TWIST_BIT(26), MT_TWIST_BIT(27), MT_TWIST_BIT(28), MT_TWIST_BIT(29),
    MT_TWIST_BIT(30), MT_TWIST_BIT(31),
#undef MT_TWIST_BIT
};

/* Rows 10 .. 321: the stream's recurrence plane by plane. Bit b of w[n] is bit b of w[n - 227], XOR bit b + 1 of
 * w[n - 623] (bit 31 of w[n - 624] for b = 30, nothing for b = 31), XOR bit 0 of w[n - 623] where MATRIX_A has
 * bit b: rows k - 4 and k - 3, k - 10 and k - 9, at fixed shifts. */
static inline void mt_grow_planes(uint64_t *P) {
    for (int k = MT_HEAD; k < MT_ROWS; k++) {
        uint64_t *row = P + 32 * k;
        const uint64_t *r4 = row - 4 * 32, *r3 = row - 3 * 32, *r10 = row - 10 * 32, *r9 = row - 9 * 32;
        uint64_t low = (r10[0] >> 17) | (r9[0] << 47);
        for (int b = 0; b < 30; b++) {
            row[b] = ((r4[b] >> 29) | (r3[b] << 35)) ^ ((r10[b + 1] >> 17) | (r9[b + 1] << 47)) ^
                     (mt_twist_mask[b] & low);
        }
        row[30] = ((r4[30] >> 29) | (r3[30] << 35)) ^ ((r10[31] >> 16) | (r9[31] << 48)) ^ (mt_twist_mask[30] & low);
        row[31] = ((r4[31] >> 29) | (r3[31] << 35)) ^ (mt_twist_mask[31] & low);
    }
}

/* out[64 m + i] from bit i of row m of the 32 result planes: per 16 planes, byte y of each gathered in a vector,
 * whose movemasks from the top are out[8 y + 7] down to out[8 y]. */
__attribute__((target("ssse3"))) static void mt_unplane(const uint64_t *R, uint32_t *out) {
    const __m128i pairs = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int m = 0; m < MT_OUT; m++) {
        uint16_t masks[2][64];
        for (int half = 0; half < 2; half++) {
            const __m128i *src = (const __m128i *)(R + 32 * m + 16 * half);
            __m128i a[8], b[8], c[8];
            for (int j = 0; j < 8; j++) { /* planes 2 j and 2 j + 1, byte by byte */
                a[j] = _mm_shuffle_epi8(_mm_loadu_si128(src + j), pairs);
            }
            for (int j = 0; j < 4; j++) { /* planes 4 j .. 4 j + 3: bytes 0 .. 3, then 4 .. 7 */
                b[2 * j] = _mm_unpacklo_epi16(a[2 * j], a[2 * j + 1]);
                b[2 * j + 1] = _mm_unpackhi_epi16(a[2 * j], a[2 * j + 1]);
            }
            for (int j = 0; j < 2; j++) { /* planes 8 j .. 8 j + 7: bytes 0, 1, then 2, 3, 4, 5, 6, 7 */
                c[4 * j] = _mm_unpacklo_epi32(b[4 * j], b[4 * j + 2]);
                c[4 * j + 1] = _mm_unpackhi_epi32(b[4 * j], b[4 * j + 2]);
                c[4 * j + 2] = _mm_unpacklo_epi32(b[4 * j + 1], b[4 * j + 3]);
                c[4 * j + 3] = _mm_unpackhi_epi32(b[4 * j + 1], b[4 * j + 3]);
            }
            for (int y = 0; y < 8; y++) { /* planes 0 .. 15, byte y */
                __m128i v = y & 1 ? _mm_unpackhi_epi64(c[y / 2], c[4 + y / 2])
                                  : _mm_unpacklo_epi64(c[y / 2], c[4 + y / 2]);
                for (int bit = 7; bit >= 0; bit--) {
                    masks[half][8 * y + bit] = (uint16_t)_mm_movemask_epi8(v);
                    v = _mm_add_epi8(v, v);
                }
            }
        }
        int count = m == MT_OUT - 1 ? MT_N - 64 * m : 64;
        for (int i = 0; i < count; i++) {
            out[64 * m + i] = (uint32_t)masks[0][i] | (uint32_t)masks[1][i] << 16;
        }
    }
}

/* The kernel. A vector holds c'[i] in both 64-bit lanes and a row of two planes side by side: selector 0x00
 * multiplies the even plane (the low half), 0x10 the odd one. Per pair of planes, the sums for d = 311 .. 321 in
 * registers, 6 at a time (SSE has 16). Result row m of a plane: the low half of sum d = 312 + m XOR the high half of
 * sum d = 311 + m. */
__attribute__((target("pclmul,sse4.1"))) static void mt_clmul128(uint64_t *P, const uint64_t *c, uint64_t *R) {
    mt_grow_planes(P);
    for (int pair = 0; pair < 16; pair++) {
        uint64_t even[MT_DS][2], odd[MT_DS][2];
        for (int first = 0; first < MT_DS; first += 6) {
            int n = MT_DS - first < 6 ? MT_DS - first : 6;
            __m128i e[6], o[6];
            for (int x = 0; x < 6; x++) {
                e[x] = o[x] = _mm_setzero_si128();
            }
            for (int i = 0; i < MT_WORDS; i++) {
                __m128i ci = _mm_set1_epi64x((long long)c[i]);
                const uint64_t *rows = P + 32 * (MT_D0 + first - i) + 2 * pair;
                for (int x = 0; x < 6; x++) {
                    if (x < n) {
                        __m128i p = _mm_loadu_si128((const __m128i *)(rows + 32 * x));
                        e[x] = _mm_xor_si128(e[x], _mm_clmulepi64_si128(ci, p, 0x00));
                        o[x] = _mm_xor_si128(o[x], _mm_clmulepi64_si128(ci, p, 0x10));
                    }
                }
            }
            for (int x = 0; x < n; x++) {
                _mm_storeu_si128((__m128i *)even[first + x], e[x]);
                _mm_storeu_si128((__m128i *)odd[first + x], o[x]);
            }
        }
        for (int m = 0; m < MT_OUT; m++) {
            uint64_t *r = R + 32 * m + 2 * pair;
            r[0] = even[m + 1][0] ^ even[m][1];
            r[1] = odd[m + 1][0] ^ odd[m][1];
        }
    }
}
#endif

static int mt_twist_supported(int method) {
    switch (method) {
    case MT_BY_WORDS:
        return 1;
#ifdef MT_X86
    case MT_BY_CLMUL128:
        return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    default:
        return 0;
    }
}

/* The best method of mt19937_twisted this CPU and build support (the last supported one). */
static int mt_best(void) {
    int best = 0;
    for (int method = 1; method < MT_TWIST_METHODS; method++) {
        if (mt_twist_supported(method)) {
            best = method;
        }
    }
    return best;
}

/* The method of mt19937_twisted `name` names, or -1 with an exception set: not a str, no such method, or one this
 * CPU or build lacks. */
static int mt_method(PyObject *name) {
    const char *function = "mt19937_twisted";
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "%s: `method` must be a str, got %.100s", function, Py_TYPE(name)->tp_name);
        return -1;
    }
    for (int method = 0; method < MT_TWIST_METHODS; method++) {
        if (PyUnicode_CompareWithASCIIString(name, mt_twist_methods[method]) == 0) {
            if (!mt_twist_supported(method)) {
                PyErr_Format(PyExc_ValueError,
                             "%s: method %R needs CPU features this machine lacks, or a build that has it; use one "
                             "of those mt19937_methods() lists",
                             function, name);
                return -1;
            }
            return method;
        }
    }
    PyErr_Format(PyExc_ValueError, "%s: no method %R; use one of those mt19937_methods() lists", function, name);
    return -1;
}

static PyObject *mt19937_power_of_x(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "mt19937_power_of_x expected 2 arguments (exponent, modulus), got %zd", nargs);
        return NULL;
    }
    Py_buffer exponent, modulus;
    if (PyObject_GetBuffer(args[0], &exponent, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &modulus, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&exponent);
        return NULL;
    }
    PyObject *result = NULL;
    uint16_t *terms = NULL;
    char *allocated = NULL;
    if (modulus.len != MT_POLY_BYTES) {
        PyErr_Format(PyExc_ValueError, "mt19937_power_of_x: `modulus` must have %d bytes, got %zd", MT_POLY_BYTES,
                     modulus.len);
        goto done;
    }
    terms = PyMem_Malloc(MT_DEGREE * sizeof(uint16_t));
    allocated = PyMem_Calloc(1, sizeof(mt_power_work) + 64); /* zeros: the quotient's padding stays 0 */
    result = PyBytes_FromStringAndSize(NULL, MT_POLY_BYTES);
    if (terms == NULL || allocated == NULL || result == NULL) {
        Py_CLEAR(result);
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    int count = mt_terms(modulus.buf, terms);
    if (count < 0) {
        Py_CLEAR(result);
        goto done;
    }
    const unsigned char *digits = exponent.buf; /* big-endian */
    Py_ssize_t bits = 8 * exponent.len;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    mt_power_work *work = (mt_power_work *)(allocated + (64 - (uintptr_t)allocated % 64)); /* cache-line aligned */
    uint64_t *a = work->power;
    Py_BEGIN_ALLOW_THREADS
    /* x^top for the exponent's leading bits while top < 19937: no reduction needed */
    Py_ssize_t bit = 0;
    long top = 0;
    for (; bit < bits; bit++) {
        int digit = digits[bit >> 3] >> (7 - (bit & 7)) & 1;
        if (2 * top + digit >= MT_DEGREE) {
            break;
        }
        top = 2 * top + digit;
    }
    a[top >> 6] = (uint64_t)1 << (top & 63);
    mt_squarings(a, digits, bit, bits, terms, count, work);
    for (int k = 0; k < MT_POLY_BYTES; k++) { /* little-endian bytes, whatever the machine's order */
        out[k] = (unsigned char)(a[k >> 3] >> (8 * (k & 7)));
    }
    Py_END_ALLOW_THREADS
done:
    PyMem_Free(terms);
    PyMem_Free(allocated);
    PyBuffer_Release(&exponent);
    PyBuffer_Release(&modulus);
    return result;
}

/* The ones of c below degree 19,937. */
static int mt_count_ones(const unsigned char *c) {
    int count = 0;
    for (int byte = 0; byte < MT_POLY_BYTES; byte++) {
        unsigned bits = c[byte];
        if (8 * byte + 8 > MT_DEGREE) {
            bits &= (1u << (MT_DEGREE - 8 * byte)) - 1;
        }
        for (; bits != 0; bits &= bits - 1) {
            count++;
        }
    }
    return count;
}

/* mt19937_twisted's scratch memory, the larger of what its two families of methods use: the stream's words and the
 * ones of c (words), or the bit planes and the array's words (carry-less). */
#define MT_BY_WORDS_BYTES (MT_STREAM * sizeof(uint32_t) + MT_DEGREE * sizeof(uint16_t))
#define MT_BY_CLMUL_BYTES (32 * MT_ROWS * sizeof(uint64_t) + MT_N * sizeof(uint32_t))
#define MT_SCRATCH_BYTES (MT_BY_WORDS_BYTES > MT_BY_CLMUL_BYTES ? MT_BY_WORDS_BYTES : MT_BY_CLMUL_BYTES)

/* One block of scratch memory kept from one call to the next. Allocated afresh, its 120 KB cost each jump 30 to 40 us
 * more (the jump takes 20) in a replay, which fills large tensors between its jumps: memory at a new address, cold in
 * the caches and the TLB, or to be faulted in. It is taken and given back with the GIL held, so calls running at once
 * in other threads allocate their own. */
static void *mt_spare_scratch;

static void *mt_scratch_take(void) {
    void *block = mt_spare_scratch;
    mt_spare_scratch = NULL;
    return block != NULL ? block : PyMem_Malloc(MT_SCRATCH_BYTES);
}

static void mt_scratch_give(void *block) {
    if (mt_spare_scratch == NULL) {
        mt_spare_scratch = block;
    } else {
        PyMem_Free(block);
    }
}

static PyObject *mt19937_twisted(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError,
                     "mt19937_twisted expected 2 arguments (array, coefficients) and an optional method, got %zd",
                     nargs);
        return NULL;
    }
    int method = -1; /* chosen by the count of ones unless forced */
    if (nargs == 3 && args[2] != Py_None &&
        (method = mt_method(args[2])) < 0) {
        return NULL;
    }
    Py_buffer array, coefficients;
    if (PyObject_GetBuffer(args[0], &array, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &coefficients, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&array);
        return NULL;
    }
    PyObject *result = NULL;
    char *scratch = NULL;
    if (array.len != MT_N * 8 || coefficients.len != MT_POLY_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "mt19937_twisted: expected an array of %d bytes and coefficients of %d bytes, got %zd and %zd",
                     MT_N * 8, MT_POLY_BYTES, array.len, coefficients.len);
        goto done;
    }
    const unsigned char *c = coefficients.buf;
    if (method < 0) {
        int best = mt_best();
        method = mt_count_ones(c) < mt_words_below[best] ? MT_BY_WORDS : best;
    }
    scratch = mt_scratch_take();
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* words: w[MT_STREAM], then ones; carry-less: the planes (8-byte words first, aligned as malloc aligns), then w */
    uint32_t *w = method == MT_BY_WORDS ? (uint32_t *)scratch : (uint32_t *)(scratch + 32 * MT_ROWS * sizeof(uint64_t));
    uint16_t *ones = (uint16_t *)(scratch + MT_STREAM * sizeof(uint32_t));
    unsigned char *words = array.buf; /* the state's array: uint64 words in native byte order, 32-bit values */
    Py_BEGIN_ALLOW_THREADS
    for (int n = 0; n < MT_N; n++) {
        uint64_t word;
        memcpy(&word, words + 8 * n, 8); /* the buffer need not be aligned */
        w[n] = (uint32_t)word;
    }
    uint32_t out[MT_N];
    if (method == MT_BY_WORDS) {
        int count = mt_ones(c, ones);
        mt_stream(w, count > 0 ? ones[count - 1] + 1 + MT_N : MT_N); /* only the words the rows read */
        mt_correlate(w, ones, count, out);
    }
#ifdef MT_X86
    else {
        uint64_t reversed[MT_WORDS], results[32 * MT_OUT], *planes = (uint64_t *)scratch;
        mt_reversed(c, reversed);
        mt_head_planes(w, planes);
        mt_clmul128(planes, reversed, results);
        mt_unplane(results, out);
    }
#endif
    for (int n = 0; n < MT_N; n++) {
        uint64_t word = out[n];
        memcpy(words + 8 * n, &word, 8);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (scratch != NULL) {
        mt_scratch_give(scratch);
    }
    PyBuffer_Release(&array);
    PyBuffer_Release(&coefficients);
    return result;
}

/* The names of the methods of mt19937_twisted that this CPU and build support, as a tuple. */
static PyObject *mt_supported_names(void) {
    PyObject *list = PyList_New(0);
    for (int method = 0; list != NULL && method < MT_TWIST_METHODS; method++) {
        if (mt_twist_supported(method)) {
            PyObject *name = PyUnicode_FromString(mt_twist_methods[method]);
            if (name == NULL || PyList_Append(list, name) < 0) {
                Py_CLEAR(list);
            }
            Py_XDECREF(name);
        }
    }
    if (list == NULL) {
        return NULL;
    }
    PyObject *names_tuple = PyList_AsTuple(list);
    Py_DECREF(list);
    return names_tuple;
}

static PyObject *mt19937_methods(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    PyObject *twist = mt_supported_names();
    PyObject *result = twist == NULL ? NULL : Py_BuildValue("{sO}", "twisted", twist);
    Py_XDECREF(twist);
    return result;
}

static PyMethodDef methods[] = {
    {"mt19937_power_of_x", (PyCFunction)(void (*)(void))mt19937_power_of_x, METH_FASTCALL,
     "mt19937_power_of_x(exponent, modulus, /)\n--\n\nx^exponent mod modulus over GF(2), bit-packed: exponent as "
     "big-endian bytes, modulus MT19937's characteristic polynomial."},
    {"mt19937_twisted", (PyCFunction)(void (*)(void))mt19937_twisted, METH_FASTCALL,
     "mt19937_twisted(array, coefficients, method=None, /)\n--\n\nReplace the MT19937 array (624 uint64 words) in "
     "place by XOR_j c_j w[j + i], i = 1 .. 624, of its untempered words w; method one of "
     "mt19937_methods()['twisted'] (None: chosen by the coefficients)."},
    {"mt19937_methods", mt19937_methods, METH_NOARGS,
     "mt19937_methods()\n--\n\nThe methods of mt19937_twisted this CPU and build support, by function name: "
     "{'twisted': (...)}, the default last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef generator_jump = {
    PyModuleDef_HEAD_INIT, "modattrs._generator_jump", "Jumping torch's CPU generator (MT19937) ahead, compiled.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__generator_jump(void) { return PyModule_Create(&generator_jump); }
