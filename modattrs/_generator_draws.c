/* Drawing from torch's CPU generator (MT19937), compiled: the uniform_ kernel of modattrs/_deferred/rng/kernels.py.
 *
 * mt19937_uniform(state, layout, address, count, dtype, low, high, form, fused) writes `count` elements of `dtype`
 * at `address` as torch's CPU uniform_(low, high) on a contiguous tensor writes them, from a generator in the state
 * at `state` (what get_state() returns: `layout` gives the offsets of left, int32, next, uint64, and the array, 624
 * uint64 words holding 32-bit values, native byte order), and moves that state forward as torch's engine does.
 * Addresses are raw: the caller holds the tensors, contiguous, of the right sizes. What torch's
 * kernel does per element (aten/src/ATen/native/cpu/DistributionTemplates.h, ATen/core/DistributionsHelper.h and
 * TransformationHelper.h): take one 32-bit output (two for float64: the first is the high word of a 64-bit draw),
 * keep its low `digits` bits, scale them by 2^-digits, exactly, and return x * (high - low) + low rounded to the
 * element's type. Which type the bounds, the digits and the arithmetic are taken in is the `form` (mt_form below):
 * torch changed it in 2.13.
 *
 * Whether the compiler that built torch fused x * range + low into one fused multiply-add is a property of torch's
 * build and of the CPU capability torch chose, not of the arguments: `fused` says which to compute (this file is
 * compiled with -ffp-contract=off, so the unfused form is two roundings), and kernels.py finds out by comparing
 * both with torch's kernel at the first use of each dtype in a process.
 *
 * The engine, as torch's (aten/src/ATen/core/MT19937RNGEngine.h): an output decrements left; when that makes it 0
 * the array is twisted and left = 624, next = 0; the output is array[next++], tempered. So left - 1 outputs remain
 * in the array before the next twist.
 *
 * The loops are written to vectorize: on x86-64 the kernel is compiled twice, for AVX2 with FMA and for the
 * baseline, and picked by the CPU's features at run time. The module is optional, as modattrs/_generator_jump.c
 * is: without it kernels.py leaves every draw to torch's kernel. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MT_N 624
#define MT_M 397
#define MT_UPPER 0x80000000u
#define MT_LOWER 0x7FFFFFFFu
#define MT_MATRIX 0x9908B0DFu
#define MT_CHUNK 2048 /* elements transformed at a time: their outputs stay in L1 */

#if defined(__x86_64__) &&                                                                                             \
    ((defined(__clang__) && __clang_major__ >= 10) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8))
#define MT_X86 1
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MT_INLINE static inline __attribute__((always_inline))
#else
#define MT_INLINE static inline
#endif

enum mt_dtype { MT_FLOAT32, MT_FLOAT64, MT_BFLOAT16, MT_DTYPES };
static const char *const mt_dtype_names[MT_DTYPES] = {"float32", "float64", "bfloat16"};

typedef struct {
    uint32_t words[MT_N];
    int left;
    int next;
} mt_engine;

/* --- bfloat16's rounding, as c10's BFloat16 constructor rounds: to nearest, ties to even ------------------------- */

MT_INLINE uint32_t mt_bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits;
}

MT_INLINE float mt_float_of(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

MT_INLINE uint16_t mt_bfloat16_of(float value) {
    uint32_t bits = mt_bits_of(value);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0x7FC0; /* NaN: c10's canonical quiet NaN */
    }
    uint32_t halfway = 0x7FFFu + ((bits >> 16) & 1u); /* below the kept bits: less than half rounds down */
    return (uint16_t)((bits + halfway) >> 16);
}

MT_INLINE float mt_float_of_bfloat16(uint16_t value) { return mt_float_of((uint32_t)value << 16); }

/* --- the engine ------------------------------------------------------------------------------------------------- */

MT_INLINE uint32_t mt_step(uint32_t upper, uint32_t lower) {
    uint32_t mixed = (upper & MT_UPPER) | (lower & MT_LOWER);
    return (mixed >> 1) ^ ((0u - (lower & 1u)) & MT_MATRIX);
}

MT_INLINE void mt_twist(uint32_t *w) {
    int i = 0;
    for (; i < MT_N - MT_M; i++) {
        w[i] = w[i + MT_M] ^ mt_step(w[i], w[i + 1]);
    }
    for (; i < MT_N - 1; i++) {
        w[i] = w[i + MT_M - MT_N] ^ mt_step(w[i], w[i + 1]);
    }
    w[MT_N - 1] = w[MT_M - 1] ^ mt_step(w[MT_N - 1], w[0]);
}

MT_INLINE uint32_t mt_tempered(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9D2C5680u;
    y ^= (y << 15) & 0xEFC60000u;
    return y ^ (y >> 18);
}

/* The engine's next `count` outputs, in order. */
MT_INLINE void mt_outputs(mt_engine *engine, uint32_t *out, size_t count) {
    size_t done = 0;
    while (done < count) {
        if (engine->left == 1) { /* the next output twists */
            mt_twist(engine->words);
            engine->left = MT_N + 1;
            engine->next = 0;
        }
        size_t take = (size_t)(engine->left - 1);
        if (take > count - done) {
            take = count - done;
        }
        const uint32_t *words = engine->words + engine->next;
        for (size_t k = 0; k < take; k++) {
            out[done + k] = mt_tempered(words[k]);
        }
        engine->next += (int)take;
        engine->left -= (int)take;
        done += take;
    }
}

/* --- the kernel ----------------------------------------------------------------------------------------------------- */

/* The two forms torch's CPU uniform_ kernel has had (DistributionTemplates.h):
 *   - MT_OPMATH (torch 2.13 and later): low, high and the arithmetic in the accumulation type (float; double for
 *     float64), its bits (24; 53), and a value that rounds to high in the element type is replaced by low;
 *   - MT_SCALAR (earlier): low, high and high - low in the element type, its bits (8 for bfloat16), the arithmetic in
 *     the accumulation type, no replacement. For float32 and float64 the two differ only by it. */
enum mt_form { MT_OPMATH, MT_SCALAR, MT_FORMS };
static const char *const mt_form_names[MT_FORMS] = {"opmath", "scalar"};

typedef struct {
    double low64, range64, high64; /* float64 */
    float low32, range32;          /* float32, and the float that bfloat16 computes in */
    float high_element;            /* high in the element type (as a float), which a value must not round to */
    uint32_t mask;                 /* the bits of an output kept, */
    float scale;                   /* and their weight: 2^-digits */
    int replace;                   /* MT_OPMATH: a value equal to high_element becomes low, in the element type */
    uint16_t low_element;          /* bfloat16: low in the element type */
} mt_bounds;

MT_INLINE void mt_uniform_body(mt_engine *engine, char *address, size_t count, int dtype, const mt_bounds *b,
                               int fused) {
    uint32_t raw[2 * MT_CHUNK];
    for (size_t first = 0; first < count; first += MT_CHUNK) {
        size_t n = count - first < MT_CHUNK ? count - first : MT_CHUNK;
        mt_outputs(engine, raw, dtype == MT_FLOAT64 ? 2 * n : n);
        if (dtype == MT_FLOAT64) {
            double *out = (double *)address + first;
            const double low = b->low64, range = b->range64, high = b->high64;
            const int replace = b->replace;
            for (size_t i = 0; i < n; i++) {
                /* the first output is the high word of the 64-bit draw, of which the low 53 bits count: both halves
                 * convert exactly, and so does their sum (below 2^53); the high half as a signed int, which it fits,
                 * because x86 has a vector conversion of signed ints only */
                double x = ((double)(int32_t)(raw[2 * i] & 0x1FFFFFu) * 0x1p32 + (double)raw[2 * i + 1]) * 0x1p-53;
                double value = fused ? fma(x, range, low) : x * range + low;
                out[i] = replace && value == high ? low : value;
            }
        } else if (dtype == MT_FLOAT32) {
            float *out = (float *)address + first;
            const float low = b->low32, range = b->range32, high = b->high_element;
            const int replace = b->replace;
            if (fused) {
                for (size_t i = 0; i < n; i++) {
                    float value = fmaf((float)(raw[i] & 0xFFFFFFu) * 0x1p-24f, range, low);
                    out[i] = replace && value == high ? low : value;
                }
            } else {
                for (size_t i = 0; i < n; i++) {
                    float value = (float)(raw[i] & 0xFFFFFFu) * 0x1p-24f * range + low;
                    out[i] = replace && value == high ? low : value;
                }
            }
        } else {
            uint16_t *out = (uint16_t *)address + first;
            const float low = b->low32, range = b->range32, scale = b->scale, high = b->high_element;
            const uint32_t mask = b->mask;
            const int replace = b->replace;
            const uint16_t low_element = b->low_element;
            for (size_t i = 0; i < n; i++) {
                float x = (float)(raw[i] & mask) * scale;
                uint16_t value = mt_bfloat16_of(fused ? fmaf(x, range, low) : x * range + low);
                out[i] = replace && mt_float_of_bfloat16(value) == high ? low_element : value;
            }
        }
    }
}

static void mt_uniform_baseline(mt_engine *engine, char *address, size_t count, int dtype, const mt_bounds *b,
                                int fused) {
    mt_uniform_body(engine, address, count, dtype, b, fused);
}

#ifdef MT_X86
__attribute__((target("avx2,fma"))) static void mt_uniform_avx2(mt_engine *engine, char *address, size_t count,
                                                                 int dtype, const mt_bounds *b, int fused) {
    mt_uniform_body(engine, address, count, dtype, b, fused);
}
#endif

static int mt_has_avx2(void) {
#ifdef MT_X86
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return known;
#else
    return 0;
#endif
}

/* low and high as torch's kernel of that form holds them. */
static mt_bounds mt_bounds_of(int dtype, int form, double low, double high) {
    mt_bounds b;
    memset(&b, 0, sizeof b);
    b.replace = form == MT_OPMATH;
    b.mask = 0xFFFFFFu;
    b.scale = 0x1p-24f;
    if (dtype == MT_FLOAT64) {
        b.low64 = low;
        b.range64 = high - low;
        b.high64 = high;
    } else if (dtype == MT_FLOAT32 || form == MT_OPMATH) {
        b.low32 = (float)low;
        b.range32 = (float)high - (float)low;
        if (dtype == MT_FLOAT32) {
            b.high_element = (float)high;
        } else {
            b.high_element = mt_float_of_bfloat16(mt_bfloat16_of((float)high));
            b.low_element = mt_bfloat16_of((float)low);
        }
    } else { /* bfloat16, MT_SCALAR: the element type's bounds, their difference rounded to it, its 8 bits */
        float from = mt_float_of_bfloat16(mt_bfloat16_of((float)low));
        float to = mt_float_of_bfloat16(mt_bfloat16_of((float)high));
        b.low32 = from;
        b.range32 = mt_float_of_bfloat16(mt_bfloat16_of(to - from));
        b.mask = 0xFFu;
        b.scale = 0x1p-8f;
    }
    return b;
}

static int mt_named(PyObject *name, const char *const *names, int count, const char *what) {
    const char *text = PyUnicode_AsUTF8(name);
    if (text == NULL) {
        return -1;
    }
    for (int i = 0; i < count; i++) {
        if (strcmp(text, names[i]) == 0) {
            return i;
        }
    }
    PyErr_Format(PyExc_ValueError, "mt19937_uniform: no %s named %R", what, name);
    return -1;
}

static PyObject *mt19937_uniform(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError,
                     "mt19937_uniform expected 9 arguments (state, layout, address, count, dtype, low, high, form, "
                     "fused), got %zd",
                     nargs);
        return NULL;
    }
    /* Each argument read and checked before the next: a conversion may run Python code (__index__, __float__). */
    unsigned char *state = PyLong_AsVoidPtr(args[0]);
    if (state == NULL && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t left_at = -1, next_at = -1, array_at = -1;
    if (!PyTuple_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "mt19937_uniform: layout must be a tuple (left_at, next_at, array_at), got %R",
                     args[1]);
        return NULL;
    }
    if (!PyArg_ParseTuple(args[1], "nnn", &left_at, &next_at, &array_at)) {
        return NULL;
    }
    void *address = PyLong_AsVoidPtr(args[2]);
    if (address == NULL && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int dtype = mt_named(args[4], mt_dtype_names, MT_DTYPES, "dtype");
    if (dtype < 0) {
        return NULL;
    }
    double low = PyFloat_AsDouble(args[5]);
    if (low == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    double high = PyFloat_AsDouble(args[6]);
    if (high == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    int form = mt_named(args[7], mt_form_names, MT_FORMS, "form");
    if (form < 0) {
        return NULL;
    }
    int fused = PyObject_IsTrue(args[8]);
    if (fused < 0) {
        return NULL;
    }
    if (state == NULL || left_at < 0 || next_at < 0 || array_at < 0 || count < 0 || (count > 0 && address == NULL)) {
        PyErr_Format(PyExc_ValueError, "mt19937_uniform: a state at %p (left at %zd, next at %zd, array at %zd), "
                     "%zd elements at %p", (void *)state, left_at, next_at, array_at, count, address);
        return NULL;
    }
    int32_t left;
    uint64_t next;
    memcpy(&left, state + left_at, sizeof left); /* the state need not be aligned */
    memcpy(&next, state + next_at, sizeof next);
    if (left < 1 || left > MT_N || next > MT_N || next + (uint64_t)left - 1 > MT_N) {
        PyErr_Format(PyExc_ValueError,
                     "mt19937_uniform: a position torch's engine never has\n  expected: 1 <= left <= %d, "
                     "next + left - 1 <= %d\n  got: left=%d, next=%llu",
                     MT_N, MT_N, (int)left, (unsigned long long)next);
        return NULL;
    }
    mt_bounds bounds = mt_bounds_of(dtype, form, low, high);
    unsigned char *words = state + array_at; /* uint64 words in native byte order, 32-bit values */
    mt_engine engine;
    engine.left = (int)left;
    engine.next = (int)next;
    Py_BEGIN_ALLOW_THREADS
    for (int n = 0; n < MT_N; n++) {
        uint64_t word;
        memcpy(&word, words + 8 * n, 8);
        engine.words[n] = (uint32_t)word;
    }
#ifdef MT_X86
    if (mt_has_avx2()) {
        mt_uniform_avx2(&engine, address, (size_t)count, dtype, &bounds, fused);
    } else
#endif
    {
        mt_uniform_baseline(&engine, address, (size_t)count, dtype, &bounds, fused);
    }
    for (int n = 0; n < MT_N; n++) {
        uint64_t word = engine.words[n];
        memcpy(words + 8 * n, &word, 8);
    }
    left = engine.left;
    next = (uint64_t)engine.next;
    memcpy(state + left_at, &left, sizeof left);
    memcpy(state + next_at, &next, sizeof next);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"mt19937_uniform", (PyCFunction)(void (*)(void))mt19937_uniform, METH_FASTCALL,
     "mt19937_uniform(state, layout, address, count, dtype, low, high, form, fused, /)\n--\n\nWrite count "
     "elements of dtype at address as torch's CPU uniform_(low, high) kernel of that form ('opmath' or 'scalar') "
     "draws them from the CPU generator state at address state (layout: the offsets of left, next and the array), "
     "and move that state forward in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef generator_draws = {
    PyModuleDef_HEAD_INIT, "modattrs._generator_draws", "Drawing from torch's CPU generator (MT19937), compiled.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__generator_draws(void) { return PyModule_Create(&generator_draws); }
