/* The attribute core's and fake mode's hot paths, compiled: VirtualTensor.value's read, and fake mode's entries.
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
 * open modattrs.cached() blocks.
 *
 * Fake mode's entries only choose a path, without starting a Python frame: dispatch_unless_compiling (fake mode's
 * dispatch entry, which dynamo must not see), forward_unless_index (the filter in front of the torch function mode
 * that makes int devices CUDA devices), instance_method.
 *
 * The module is optional: pip builds it when a C compiler is there, and without it virtual.py and modattrs/_fake
 * run the same steps in Python. The generator's jump is compiled apart, in modattrs/_generator_jump.c. */
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
 * modattrs/_compiled.py: being C, this call starts no Python frame for dynamo to intercept before it decides. */
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups = {
    PyModuleDef_HEAD_INIT, "modattrs._speedups", "VirtualTensor.value's read and fake mode's entries, compiled.", -1,
    methods, NULL, NULL, NULL, NULL,
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
