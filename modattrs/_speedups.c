/* The hot path of VirtualTensor.value, compiled.
 *
 * read(attribute) does what VirtualTensor._read does for an uncached attribute whose reference buffer is plain,
 * unchanged since it was checked, and on the CPU: call the materializer with the reference's dtype (or the fixed
 * one) and the CPU, and return the result when it already has them. Every other case, and every result that
 * needs converting, goes to the Python methods (_read, _converted), which stay the one definition of what .value
 * means; this file only skips the interpreter on the way. On Python 3.11 the property's frame and a dozen
 * attribute reads cost about a third of a small materializer (torch.arange(8)); here they cost a sixth.
 *
 * Read directly: the attribute's own fields, at the offsets of its __slots__ (bind() finds them in the class's
 * member descriptors), and torch.Tensor's dtype and is_cpu, through their getters. Read as Python reads them: the
 * weak reference to the owner, the owner's buffer table (bind() gets its name from _torch_private), the count of
 * open modattrs.cached() blocks. The module is optional: pip builds it when a C compiler is there, and without it
 * virtual.py reads the same values in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* Interned names, and what read() needs of torch, set once by the module's init. */
static PyObject *str_dtype, *str_is_cpu, *str_device, *str_open_scopes, *str_converted, *str_positions;
static PyObject *tensor_type; /* torch.Tensor */
static PyObject *cpu;         /* torch.device("cpu") */
/* torch.Tensor's dtype, is_cpu and device getters, called directly on tensors of that exact type: what Python's
 * attribute lookup finds for them, without the lookup. NULL if a torch defines them otherwise: then looked up. */
static getter get_dtype, get_is_cpu, get_device;
static void *dtype_closure, *is_cpu_closure, *device_closure;

/* Set by bind(): the VirtualTensor class and the offsets of its slots; nn.Module's name for its buffer dictionary;
 * VirtualTensor._read, modattrs._cache.read and _cache's namespace (for open_scopes, the cached() blocks open). */
static PyTypeObject *attribute_type;
static Py_ssize_t owner_ref_at, ref_name_at, plain_ref_at, fixed_dtype_at, function_at;
static PyObject *buffer_table, *python_read, *cache_read, *cache_globals;

/* The slot at `offset` of `obj`: a borrowed reference, NULL if it is not set. */
static inline PyObject *slot(PyObject *obj, Py_ssize_t offset) { return *(PyObject **)((char *)obj + offset); }

/* tensor.<name> through its getter if it has one, for a tensor whose type is exactly torch.Tensor. */
static inline PyObject *tensor_attribute(PyObject *tensor, getter get, void *closure, PyObject *name) {
    return get != NULL ? get(tensor, closure) : PyObject_GetAttr(tensor, name);
}

/* 1 if tensor.is_cpu, 0 if not, -1 on error, for a tensor whose type is exactly torch.Tensor. */
static int on_cpu(PyObject *tensor) {
    PyObject *answer = tensor_attribute(tensor, get_is_cpu, is_cpu_closure, str_is_cpu);
    if (answer == NULL) {
        return -1;
    }
    int is_cpu = answer == Py_True;
    Py_DECREF(answer);
    return is_cpu;
}

/* 1 if `result` is a torch.Tensor of `dtype` on `device` (the CPU when `device` is cpu), 0 if not, -1 on error. */
static int as_asked(PyObject *result, PyObject *dtype, PyObject *device) {
    if ((PyObject *)Py_TYPE(result) != tensor_type) {
        return 0;
    }
    PyObject *result_dtype = tensor_attribute(result, get_dtype, dtype_closure, str_dtype);
    if (result_dtype == NULL) {
        return -1;
    }
    int same_dtype = result_dtype == dtype; /* dtypes are singletons */
    Py_DECREF(result_dtype);
    if (!same_dtype) {
        return 0;
    }
    if (device == cpu) {
        return on_cpu(result);
    }
    PyObject *result_device = tensor_attribute(result, get_device, device_closure, str_device);
    if (result_device == NULL) {
        return -1;
    }
    int same = PyObject_RichCompareBool(result_device, device, Py_EQ);
    Py_DECREF(result_device);
    return same;
}

/* The materializer's value for a plain reference `ref` of dtype `dtype`: VirtualTensor._read's hot path. */
static PyObject *plain_value(PyObject *attribute, PyObject *function, PyObject *owner, PyObject *ref,
                             PyObject *dtype) {
    int ref_on_cpu = on_cpu(ref);
    if (ref_on_cpu < 0) {
        return NULL;
    }
    PyObject *device = ref_on_cpu ? Py_NewRef(cpu) : tensor_attribute(ref, get_device, device_closure, str_device);
    if (device == NULL) {
        return NULL;
    }
    PyObject *value = NULL, *args[3] = {owner, dtype, device};
    /* Counted once more than read() itself: here the materializer runs in an interpreter loop of its own on the C
     * stack, where the Python read's call to it stays in its caller's. */
    if (Py_EnterRecursiveCall(" while calling a VirtualTensor's materializer")) {
        Py_DECREF(device);
        return NULL;
    }
    PyObject *result = PyObject_Vectorcall(function, args, 3, NULL);
    Py_LeaveRecursiveCall();
    if (result != NULL) {
        int fine = as_asked(result, dtype, device);
        if (fine > 0) {
            value = Py_NewRef(result);
        } else if (fine == 0) {
            value = PyObject_CallMethodObjArgs(attribute, str_converted, result, dtype, device, NULL);
        }
    }
    Py_XDECREF(result);
    Py_DECREF(device);
    return value;
}

/* VirtualTensor._read(attribute), step by step. Every object is held by a reference of its own while it is used:
 * Python code can run in between (a torch function mode asked for a dtype, the materializer) and change the
 * attribute or the buffers. */
static PyObject *read_bound(PyObject *attribute) {
    PyObject *owner_ref = slot(attribute, owner_ref_at), *ref_name = slot(attribute, ref_name_at);
    PyObject *plain_ref = slot(attribute, plain_ref_at), *fixed_dtype = slot(attribute, fixed_dtype_at);
    PyObject *function = slot(attribute, function_at);
    if (owner_ref == NULL || ref_name == NULL || plain_ref == NULL || fixed_dtype == NULL || function == NULL) {
        return PyObject_CallOneArg(python_read, attribute); /* an unset slot: Python says which */
    }
    Py_INCREF(owner_ref);
    Py_INCREF(ref_name);
    Py_INCREF(plain_ref);
    Py_INCREF(fixed_dtype);
    Py_INCREF(function);
    PyObject *owner = NULL, *buffers = NULL, *ref = NULL, *dtype = NULL, *value = NULL;
    owner = PyObject_CallNoArgs(owner_ref);
    if (owner == NULL) {
        goto done;
    }
    if (owner == Py_None) { /* the owner is gone: Python says so */
        value = PyObject_CallOneArg(python_read, attribute);
        goto done;
    }
    buffers = PyObject_GetAttr(owner, buffer_table);
    if (buffers == NULL) {
        goto done;
    }
    if (!PyDict_CheckExact(buffers)) {
        value = PyObject_CallOneArg(python_read, attribute);
        goto done;
    }
    ref = Py_XNewRef(PyDict_GetItemWithError(buffers, ref_name));
    if (ref == NULL && PyErr_Occurred()) {
        goto done;
    }
    if (ref != NULL && ref == plain_ref) {
        if ((PyObject *)Py_TYPE(ref) != tensor_type) { /* a plain reference is a torch.Tensor, unless its class was
                                                          changed since: Python reads it */
            value = PyObject_CallOneArg(python_read, attribute);
            goto done;
        }
        PyObject *scopes = PyDict_GetItemWithError(cache_globals, str_open_scopes); /* an int: no code runs */
        if (scopes == NULL) {
            goto done;
        }
        int scoped = PyObject_IsTrue(scopes);
        if (scoped < 0) {
            goto done;
        }
        if (!scoped) {
            dtype = fixed_dtype != Py_None ? Py_NewRef(fixed_dtype)
                                           : tensor_attribute(ref, get_dtype, dtype_closure, str_dtype);
            if (dtype != NULL) {
                value = plain_value(attribute, function, owner, ref, dtype);
            }
            goto done;
        }
    }
    {
        PyObject *args[3] = {attribute, owner, ref != NULL ? ref : Py_None};
        value = PyObject_Vectorcall(cache_read, args, 3, NULL);
    }
done:
    Py_DECREF(owner_ref);
    Py_DECREF(ref_name);
    Py_DECREF(plain_ref);
    Py_DECREF(fixed_dtype);
    Py_DECREF(function);
    Py_XDECREF(owner);
    Py_XDECREF(buffers);
    Py_XDECREF(ref);
    Py_XDECREF(dtype);
    return value;
}

static PyObject *read_value(PyObject *Py_UNUSED(module), PyObject *attribute) {
    if (attribute_type == NULL) {
        return PyErr_Format(PyExc_RuntimeError, "modattrs._speedups.read() before bind()");
    }
    if (!PyObject_TypeCheck(attribute, attribute_type)) {
        return PyErr_Format(PyExc_TypeError, "read() takes a VirtualTensor, got %R", attribute);
    }
    /* Counted against the recursion limit as CPython counts its own calls: a materializer that reads its own value
     * then raises RecursionError, as the Python read does, instead of overflowing the C stack when
     * sys.setrecursionlimit() is high. */
    if (Py_EnterRecursiveCall(" while reading a VirtualTensor's value")) {
        return NULL;
    }
    PyObject *value = read_bound(attribute);
    Py_LeaveRecursiveCall();
    return value;
}

/* dispatch_unless_compiling(frame_hook, raw, wrapped, *args, **kwargs): raw(*args, **kwargs) while no dynamo frame
 * hook is set (frame_hook() is None), else wrapped(*args, **kwargs). See Note [A dispatch entry dynamo cannot see] in
 * modattrs/_fake/mode.py: being C, this call starts no Python frame for dynamo to intercept before it decides. */
static PyObject *dispatch_unless_compiling(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                           PyObject *kwnames) {
    if (nargs < 3) {
        return PyErr_Format(PyExc_TypeError, "dispatch_unless_compiling() takes frame_hook, raw, wrapped, *args");
    }
    PyObject *hook = PyObject_CallNoArgs(args[0]);
    if (hook == NULL) {
        return NULL;
    }
    PyObject *target = hook == Py_None ? args[1] : args[2];
    Py_DECREF(hook);
    return PyObject_Vectorcall(target, args + 3, (size_t)(nargs - 3), kwnames);
}

/* Whether torch may read `value` as a device index: an int that is not a bool, or another object with __index__
 * that is not a string. Only a filter: the Python method decides for what passes it. */
static int may_be_index(PyObject *value) {
    if (PyLong_Check(value)) {
        return !PyBool_Check(value);
    }
    return value != Py_None && !PyUnicode_Check(value) && PyIndex_Check(value);
}

/* forward_unless_index(python_method, mode, func, types, args, kwargs=None): func(*args, **kwargs) when no argument
 * that IntDevicesAreCuda rewrites may be an index (kwargs["device"], and args[mode._positions[func]]), else
 * python_method(mode, func, types, args, kwargs). See modattrs/_fake/spoofed_cuda.py. */
static PyObject *forward_unless_index(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 5 || nargs > 6 || !PyTuple_Check(args[4])) {
        return PyErr_Format(PyExc_TypeError,
                            "forward_unless_index() takes python_method, mode, func, types, a tuple of args, kwargs");
    }
    PyObject *mode = args[1], *func = args[2], *call_args = args[4];
    PyObject *kwargs = nargs == 6 && args[5] != Py_None ? args[5] : NULL;
    if (kwargs != NULL && !PyDict_Check(kwargs)) {
        return PyErr_Format(PyExc_TypeError, "forward_unless_index(): kwargs must be a dict or None, got %R", kwargs);
    }
    int slow = 0;
    if (kwargs != NULL) {
        PyObject *device = PyDict_GetItemWithError(kwargs, str_device);
        if (device == NULL && PyErr_Occurred()) {
            return NULL;
        }
        slow = device != NULL && may_be_index(device);
    }
    if (!slow) {
        PyObject *positions = PyObject_GetAttr(mode, str_positions);
        if (positions == NULL) {
            return NULL;
        }
        PyObject *position = PyDict_Check(positions) ? PyDict_GetItemWithError(positions, func) : NULL;
        if (position != NULL) {
            Py_ssize_t at = PyLong_AsSsize_t(position);
            slow = at >= 0 && at < PyTuple_GET_SIZE(call_args) && may_be_index(PyTuple_GET_ITEM(call_args, at));
        }
        Py_DECREF(positions);
        if (PyErr_Occurred()) {
            return NULL;
        }
    }
    if (slow) {
        return PyObject_Vectorcall(args[0], args + 1, (size_t)(nargs - 1), NULL);
    }
    return PyObject_Call(func, call_args, kwargs);
}

static PyObject *instance_method(PyObject *Py_UNUSED(module), PyObject *callable) {
    return PyInstanceMethod_New(callable);
}

/* The offset of the slot `name` of `cls`, or -1 with an exception set. */
static Py_ssize_t slot_offset(PyTypeObject *cls, const char *name) {
    PyObject *descriptor = PyObject_GetAttrString((PyObject *)cls, name);
    if (descriptor == NULL) {
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descriptor, &PyMemberDescr_Type) &&
        ((PyMemberDescrObject *)descriptor)->d_member->type == T_OBJECT_EX) {
        offset = ((PyMemberDescrObject *)descriptor)->d_member->offset;
    } else {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", cls->tp_name, name);
    }
    Py_DECREF(descriptor);
    return offset;
}

static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *cls, *table, *cache;
    if (!PyArg_ParseTuple(args, "O!UO!:bind", &PyType_Type, &cls, &table, &PyModule_Type, &cache)) {
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    Py_ssize_t owner_ref = slot_offset(type, "_owner_ref"), ref_name = slot_offset(type, "_ref_name"),
               plain_ref = slot_offset(type, "_plain_ref"), fixed_dtype = slot_offset(type, "_dtype"),
               function = slot_offset(type, "_function");
    if (owner_ref < 0 || ref_name < 0 || plain_ref < 0 || fixed_dtype < 0 || function < 0) {
        return NULL;
    }
    PyObject *read = PyObject_GetAttrString(cls, "_read");
    PyObject *cached_read = read == NULL ? NULL : PyObject_GetAttrString(cache, "read");
    if (cached_read == NULL) {
        Py_XDECREF(read);
        return NULL;
    }
    Py_INCREF(table);
    PyUnicode_InternInPlace(&table);
    Py_XSETREF(attribute_type, (PyTypeObject *)Py_NewRef(cls));
    Py_XSETREF(buffer_table, table);
    Py_XSETREF(python_read, read);
    Py_XSETREF(cache_read, cached_read);
    Py_XSETREF(cache_globals, Py_NewRef(PyModule_GetDict(cache)));
    owner_ref_at = owner_ref, ref_name_at = ref_name, plain_ref_at = plain_ref, fixed_dtype_at = fixed_dtype;
    function_at = function;
    Py_RETURN_NONE;
}

/* --- Jumping torch's CPU generator (MT19937) ahead: the two loops of modattrs/_deferred/mt19937.py's jumps ----------
 *
 * mt19937_power_of_x(exponent, modulus) computes x^exponent mod p over GF(2) by squaring (and multiplying by x) one
 * bit of the exponent at a time; mt19937_twisted(array, coefficients) turns the engine's array into the array after
 * the twists that x^M mod p = sum c_j x^j stands for: w[M + i] = XOR_j c_j w[j + i], i = 1 .. 624, from the
 * untempered words w[0 .. 20560] the array starts. Polynomials are bit-packed little-endian (coefficient j is bit
 * j % 8 of byte j / 8), as Python's int.to_bytes(n, "little") packs them. mt19937.py does the same in torch when
 * this extension is not built, with the same results. Both release the GIL: jumps in several threads run at once. */

#include <stdint.h>
#include <string.h>

#define MT_N 624
#define MT_DEGREE 19937                      /* of p: the state's bits */
#define MT_STREAM (MT_DEGREE + MT_N)         /* untempered words w[0 .. 20560] */
#define MT_POLY_BYTES ((MT_DEGREE + 1 + 7) / 8) /* 2,493: p, or a polynomial of degree below 19,937 */
#define MT_WORDS 312                         /* 64-bit words of a reduced polynomial, stored times x^MT_OFFSET */
#define MT_OFFSET (64 * MT_WORDS - MT_DEGREE) /* 31: so that the bits of degree 19,937 and up start at word 312 */
#define MT_BLOCK 8                           /* words reduced at once: 512 bits, less than p's gap (checked) */

/* The low 32 bits of x spread to the even bits: its square over GF(2). */
static inline uint64_t mt_spread(uint64_t x) {
    x &= 0xFFFFFFFFu;
    x = (x | (x << 16)) & 0x0000FFFF0000FFFFull;
    x = (x | (x << 8)) & 0x00FF00FF00FF00FFull;
    x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0Full;
    x = (x | (x << 2)) & 0x3333333333333333ull;
    return (x | (x << 1)) & 0x5555555555555555ull;
}

/* buf (2 * MT_WORDS words, bits stored at degree + MT_OFFSET) reduced mod p: p's terms below its degree are
 * `terms`. Top down, a block of 8 words (512 bits) at a time: the block's bits times x^(e - 19937), for each term
 * e, land below the block (every e is at most 19937 - 623), in words not yet reduced or below degree 19,937. */
static void mt_reduce(uint64_t *buf, const uint16_t *terms, int count) {
    for (int block = 2 * MT_WORDS - MT_BLOCK; block >= MT_WORDS; block -= MT_BLOCK) {
        uint64_t high[MT_BLOCK + 2] = {0};
        for (int i = 0; i < MT_BLOCK; i++) {
            high[i + 1] = buf[block + i];
            buf[block + i] = 0;
        }
        for (int t = 0; t < count; t++) {
            int base = 64 * block - MT_DEGREE + terms[t]; /* where the block's bit 0 lands */
            uint64_t *target = buf + (base >> 6);
            int shift = base & 63;
            for (int i = 0; i <= MT_BLOCK; i++) {
                target[i] ^= (high[i + 1] << shift) | ((high[i] >> 1) >> (63 - shift));
            }
        }
    }
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
 * 19,937 or whose terms below it come too close to it for mt_reduce. */
static int mt_terms(const unsigned char *modulus, uint16_t *terms) {
    int count = mt_ones(modulus, terms);
    int leading = modulus[MT_DEGREE >> 3] >> (MT_DEGREE & 7);
    if (leading != 1 || (count > 0 && terms[count - 1] > MT_DEGREE - 64 * MT_BLOCK)) {
        PyErr_SetString(PyExc_ValueError,
                        "mt19937_power_of_x: `modulus` is not MT19937's characteristic polynomial: expected "
                        "degree 19937 and no other term above degree 19425");
        return -1;
    }
    return count;
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
    uint64_t *buf = NULL, *square = NULL;
    if (modulus.len != MT_POLY_BYTES) {
        PyErr_Format(PyExc_ValueError, "mt19937_power_of_x: `modulus` must have %d bytes, got %zd", MT_POLY_BYTES,
                     modulus.len);
        goto done;
    }
    terms = PyMem_Malloc(MT_DEGREE * sizeof(uint16_t));
    buf = PyMem_Calloc(2 * MT_WORDS, sizeof(uint64_t));
    square = PyMem_Calloc(2 * MT_WORDS + 1, sizeof(uint64_t));
    result = PyBytes_FromStringAndSize(NULL, MT_POLY_BYTES);
    if (terms == NULL || buf == NULL || square == NULL || result == NULL) {
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
    long stored = top + MT_OFFSET;
    buf[stored >> 6] = (uint64_t)1 << (stored & 63);
    for (; bit < bits; bit++) {
        /* r^2 (times x for a 1 bit): the square is stored at 2 (degree + 31); shifting right by 31 (30) stores
         * it at degree + 31 (+ 1) */
        int digit = digits[bit >> 3] >> (7 - (bit & 7)) & 1;
        for (int i = 0; i < MT_WORDS; i++) {
            square[2 * i] = mt_spread(buf[i]);
            square[2 * i + 1] = mt_spread(buf[i] >> 32);
        }
        int right = MT_OFFSET - digit;
        for (int i = 0; i < 2 * MT_WORDS; i++) {
            buf[i] = (square[i] >> right) | (square[i + 1] << (64 - right));
        }
        mt_reduce(buf, terms, count);
    }
    for (int k = 0; k < MT_POLY_BYTES; k++) { /* the bits from degree 0 on, as bytes */
        int at = 8 * k + MT_OFFSET;
        uint64_t word = buf[at >> 6] >> (at & 63);
        if ((at & 63) > 56) {
            word |= buf[(at >> 6) + 1] << (64 - (at & 63));
        }
        out[k] = (unsigned char)word;
    }
    out[MT_POLY_BYTES - 1] &= (1 << (MT_DEGREE & 7)) - 1;
    Py_END_ALLOW_THREADS
done:
    PyMem_Free(terms);
    PyMem_Free(buf);
    PyMem_Free(square);
    PyBuffer_Release(&exponent);
    PyBuffer_Release(&modulus);
    return result;
}

/* out[t] = XOR over the positions j in `ones` of w[j + 1 + t], t = 0 .. 623, a tile of outputs at a time: each
 * tile's XORs stay in registers while the rows stream past (about 10,000 rows of 624 words). GCC and Clang get
 * vector types, 16 bytes wide, and on x86-64 a second copy 32 bytes wide for CPUs with AVX2 (0.26 and 0.17 ms
 * measured on an AMD EPYC); other compilers a plain loop (about 0.5 ms). */
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

#if defined(__x86_64__)
#define MT_AVX2 1
typedef uint32_t mt_lanes8 __attribute__((vector_size(32), aligned(4)));
#define MT_TILE8 6 /* vectors: 48 words, 13 tiles */

__attribute__((target("avx2"))) static void mt_correlate_avx2(const uint32_t *w, const uint16_t *ones, int count,
                                                              uint32_t *out) {
    for (int first = 0; first < MT_N; first += 8 * MT_TILE8) {
        mt_lanes8 acc[MT_TILE8] = {{0}};
        for (int k = 0; k < count; k++) {
            const mt_lanes8 *row = (const mt_lanes8 *)(w + ones[k] + 1 + first);
            for (int i = 0; i < MT_TILE8; i++) {
                acc[i] ^= row[i];
            }
        }
        memcpy(out + first, acc, sizeof acc);
    }
}
#endif
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

static PyObject *mt19937_twisted(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "mt19937_twisted expected 2 arguments (array, coefficients), got %zd", nargs);
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
    uint32_t *w = NULL;
    uint16_t *ones = NULL;
    if (array.len != MT_N * 8 || coefficients.len != MT_POLY_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "mt19937_twisted: expected an array of %d bytes and coefficients of %d bytes, got %zd and %zd",
                     MT_N * 8, MT_POLY_BYTES, array.len, coefficients.len);
        goto done;
    }
    w = PyMem_Malloc(MT_STREAM * sizeof(uint32_t));
    ones = PyMem_Malloc(MT_DEGREE * sizeof(uint16_t));
    if (w == NULL || ones == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *words = array.buf; /* the state's array: uint64 words in native byte order, 32-bit values */
    const unsigned char *c = coefficients.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int n = 0; n < MT_N; n++) {
        uint64_t word;
        memcpy(&word, words + 8 * n, 8); /* the buffer need not be aligned */
        w[n] = (uint32_t)word;
    }
    /* w[n] = w[n - 227] ^ twist(w[n - 624], w[n - 623]), as torch's engine twists */
    for (int n = MT_N; n < MT_STREAM; n++) {
        uint32_t mixed = (w[n - MT_N] & 0x80000000u) | (w[n - MT_N + 1] & 0x7FFFFFFFu);
        w[n] = w[n - 227] ^ (mixed >> 1) ^ ((0u - (mixed & 1u)) & 0x9908B0DFu);
    }
    int count = mt_ones(c, ones);
    uint32_t out[MT_N];
#ifdef MT_AVX2
    if (__builtin_cpu_supports("avx2")) {
        mt_correlate_avx2(w, ones, count, out);
    } else
#endif
    {
        mt_correlate(w, ones, count, out);
    }
    for (int n = 0; n < MT_N; n++) {
        uint64_t word = out[n];
        memcpy(words + 8 * n, &word, 8);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(w);
    PyMem_Free(ones);
    PyBuffer_Release(&array);
    PyBuffer_Release(&coefficients);
    return result;
}

static PyMethodDef methods[] = {
    {"read", read_value, METH_O,
     "read(attribute, /)\n--\n\nThe value of a VirtualTensor: what VirtualTensor._read(attribute) returns."},
    {"bind", bind, METH_VARARGS,
     "bind(cls, buffer_table, cache, /)\n--\n\nRead instances of the VirtualTensor class cls: find the slots that "
     "read() reads, and take nn.Module's name for its buffer dictionary and the module modattrs._cache."},
    {"dispatch_unless_compiling", (PyCFunction)(void (*)(void))dispatch_unless_compiling,
     METH_FASTCALL | METH_KEYWORDS,
     "dispatch_unless_compiling(frame_hook, raw, wrapped, /, *args, **kwargs)\n--\n\nraw(*args, **kwargs) if "
     "frame_hook() is None, else wrapped(*args, **kwargs), without starting a Python frame first."},
    {"forward_unless_index", (PyCFunction)(void (*)(void))forward_unless_index, METH_FASTCALL,
     "forward_unless_index(python_method, mode, func, types, args, kwargs=None, /)\n--\n\nfunc(*args, **kwargs) "
     "if no device argument may be an index, else python_method(mode, func, types, args, kwargs)."},
    {"instance_method", instance_method, METH_O,
     "instance_method(callable, /)\n--\n\ncallable made a method: as a class attribute, it is called with the "
     "instance first, as a function defined in the class is."},
    {"mt19937_power_of_x", (PyCFunction)(void (*)(void))mt19937_power_of_x, METH_FASTCALL,
     "mt19937_power_of_x(exponent, modulus, /)\n--\n\nx^exponent mod modulus over GF(2), bit-packed: exponent as "
     "big-endian bytes, modulus MT19937's characteristic polynomial."},
    {"mt19937_twisted", (PyCFunction)(void (*)(void))mt19937_twisted, METH_FASTCALL,
     "mt19937_twisted(array, coefficients, /)\n--\n\nReplace the MT19937 array (624 uint64 words) in place by "
     "XOR_j c_j w[j + i], i = 1 .. 624, of its untempered words w."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups = {
    PyModuleDef_HEAD_INIT, "modattrs._speedups", "The hot path of VirtualTensor.value, compiled.", -1, methods,
    NULL, NULL, NULL, NULL,
};

/* Find the getter of torch.Tensor's attribute `name` if it is a C getset descriptor (it is on torch 2.8 to 2.15),
 * else leave *get NULL. -1 with an exception set if torch.Tensor has no such attribute. */
static int tensor_getter(const char *name, getter *get, void **closure) {
    PyObject *descriptor = PyObject_GetAttrString(tensor_type, name);
    if (descriptor == NULL) {
        return -1;
    }
    if (Py_IS_TYPE(descriptor, &PyGetSetDescr_Type)) {
        *get = ((PyGetSetDescrObject *)descriptor)->d_getset->get;
        *closure = ((PyGetSetDescrObject *)descriptor)->d_getset->closure;
    }
    Py_DECREF(descriptor); /* the class keeps it, and its getset */
    return 0;
}

static int intern(PyObject **name, const char *text) {
    *name = PyUnicode_InternFromString(text);
    return *name == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__speedups(void) {
    if (intern(&str_dtype, "dtype") || intern(&str_is_cpu, "is_cpu") || intern(&str_device, "device") ||
        intern(&str_open_scopes, "open_scopes") || intern(&str_converted, "_converted") ||
        intern(&str_positions, "_positions")) {
        return NULL;
    }
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) {
        return NULL;
    }
    tensor_type = PyObject_GetAttrString(torch, "Tensor");
    cpu = tensor_type == NULL ? NULL : PyObject_CallMethod(torch, "device", "s", "cpu");
    Py_DECREF(torch);
    if (cpu == NULL || tensor_getter("dtype", &get_dtype, &dtype_closure) ||
        tensor_getter("is_cpu", &get_is_cpu, &is_cpu_closure) ||
        tensor_getter("device", &get_device, &device_closure)) {
        return NULL;
    }
    return PyModule_Create(&speedups);
}
