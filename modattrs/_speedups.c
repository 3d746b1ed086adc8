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

/* Interned names, and what read() needs of torch and modattrs, set once by the module's init. */
static PyObject *str_dtype, *str_is_cpu, *str_open_scopes, *str_read, *str_converted;
static PyObject *tensor_type;   /* torch.Tensor */
static PyObject *cpu;           /* torch.device("cpu") */
static PyObject *cache_globals; /* modattrs._cache's namespace, for open_scopes: the modattrs.cached() blocks open */
/* torch.Tensor's dtype and is_cpu getters, called directly on tensors of that exact type: what Python's attribute
 * lookup finds for them, without the lookup. NULL if a torch defines them otherwise: then looked up. */
static getter get_dtype, get_is_cpu;
static void *dtype_closure, *is_cpu_closure;

/* Set by bind(): nn.Module's name for its buffer dictionary, the VirtualTensor class, the offsets of its slots. */
static PyObject *buffer_table;

static PyTypeObject *attribute_type;
static Py_ssize_t owner_ref_at, ref_name_at, plain_ref_at, fixed_dtype_at, function_at;

/* The slot at `offset` of `obj`: a borrowed reference, NULL if it is not set. */
static inline PyObject *slot(PyObject *obj, Py_ssize_t offset) { return *(PyObject **)((char *)obj + offset); }

/* tensor.dtype, for a tensor whose type is exactly torch.Tensor. */
static inline PyObject *dtype_of(PyObject *tensor) {
    return get_dtype != NULL ? get_dtype(tensor, dtype_closure) : PyObject_GetAttr(tensor, str_dtype);
}

/* 1 if tensor.is_cpu, 0 if not, -1 on error, for a tensor whose type is exactly torch.Tensor. */
static int on_cpu(PyObject *tensor) {
    PyObject *answer =
        get_is_cpu != NULL ? get_is_cpu(tensor, is_cpu_closure) : PyObject_GetAttr(tensor, str_is_cpu);
    if (answer == NULL) {
        return -1;
    }
    int is_cpu = answer == Py_True;
    Py_DECREF(answer);
    return is_cpu;
}

/* The value on the fast path; NULL with an exception set; or NULL without one: not on the fast path. Every object
 * is held by a reference of its own while it is used: Python code can run in between (a torch function mode asked
 * for a dtype, the materializer), and may change the attribute or the buffers. */
static PyObject *fast_value(PyObject *attribute) {
    PyObject *owner_ref = slot(attribute, owner_ref_at), *ref_name = slot(attribute, ref_name_at);
    PyObject *plain_ref = slot(attribute, plain_ref_at), *fixed_dtype = slot(attribute, fixed_dtype_at);
    PyObject *function = slot(attribute, function_at);
    if (owner_ref == NULL || ref_name == NULL || plain_ref == NULL || plain_ref == Py_None || fixed_dtype == NULL ||
        function == NULL) {
        return NULL;
    }
    Py_INCREF(owner_ref);
    Py_INCREF(ref_name);
    Py_INCREF(plain_ref);
    Py_INCREF(fixed_dtype);
    Py_INCREF(function);
    PyObject *owner = NULL, *buffers = NULL, *ref = NULL, *scopes = NULL, *dtype = NULL, *result = NULL;
    PyObject *result_dtype = NULL, *value = NULL;
    owner = PyObject_CallNoArgs(owner_ref);
    if (owner == NULL || owner == Py_None) { /* the owner is gone: _read says so */
        goto done;
    }
    buffers = PyObject_GetAttr(owner, buffer_table);
    if (buffers == NULL || !PyDict_CheckExact(buffers)) {
        goto done;
    }
    ref = Py_XNewRef(PyDict_GetItemWithError(buffers, ref_name));
    if (ref != plain_ref || (PyObject *)Py_TYPE(ref) != tensor_type) { /* a plain reference is a torch.Tensor */
        goto done;
    }
    scopes = Py_XNewRef(PyDict_GetItemWithError(cache_globals, str_open_scopes));
    if (scopes == NULL || PyObject_IsTrue(scopes) != 0) {
        goto done;
    }
    dtype = fixed_dtype != Py_None ? Py_NewRef(fixed_dtype) : dtype_of(ref);
    if (dtype == NULL || on_cpu(ref) != 1) { /* on another device: _read compares devices */
        goto done;
    }
    PyObject *args[3] = {owner, dtype, cpu};
    result = PyObject_Vectorcall(function, args, 3, NULL);
    if (result == NULL) {
        goto done;
    }
    if ((PyObject *)Py_TYPE(result) == tensor_type) {
        result_dtype = dtype_of(result);
        if (result_dtype == NULL) {
            goto done;
        }
        if (result_dtype == dtype) {
            int result_on_cpu = on_cpu(result);
            if (result_on_cpu != 0) {
                value = result_on_cpu == 1 ? Py_NewRef(result) : NULL;
                goto done;
            }
        }
    }
    value = PyObject_CallMethodObjArgs(attribute, str_converted, result, dtype, cpu, NULL);
done:
    Py_DECREF(owner_ref);
    Py_DECREF(ref_name);
    Py_DECREF(plain_ref);
    Py_DECREF(fixed_dtype);
    Py_DECREF(function);
    Py_XDECREF(owner);
    Py_XDECREF(buffers);
    Py_XDECREF(ref);
    Py_XDECREF(scopes);
    Py_XDECREF(dtype);
    Py_XDECREF(result);
    Py_XDECREF(result_dtype);
    return value;
}

static PyObject *read_value(PyObject *Py_UNUSED(module), PyObject *attribute) {
    if (attribute_type != NULL && PyObject_TypeCheck(attribute, attribute_type)) {
        PyObject *value = fast_value(attribute);
        if (value != NULL || PyErr_Occurred()) {
            return value;
        }
    }
    return PyObject_CallMethodNoArgs(attribute, str_read);
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
    PyObject *cls, *table;
    if (!PyArg_ParseTuple(args, "O!U:bind", &PyType_Type, &cls, &table)) {
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    Py_ssize_t owner_ref = slot_offset(type, "_owner_ref"), ref_name = slot_offset(type, "_ref_name"),
               plain_ref = slot_offset(type, "_plain_ref"), fixed_dtype = slot_offset(type, "_dtype"),
               function = slot_offset(type, "_function");
    if (owner_ref < 0 || ref_name < 0 || plain_ref < 0 || fixed_dtype < 0 || function < 0) {
        return NULL;
    }
    Py_XSETREF(attribute_type, (PyTypeObject *)Py_NewRef(cls));
    Py_INCREF(table);
    PyUnicode_InternInPlace(&table);
    Py_XSETREF(buffer_table, table);
    owner_ref_at = owner_ref, ref_name_at = ref_name, plain_ref_at = plain_ref, fixed_dtype_at = fixed_dtype;
    function_at = function;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"read", read_value, METH_O,
     "read(attribute, /)\n--\n\nThe value of a VirtualTensor: what its _read() returns, with the plain reference "
     "on the CPU read without the interpreter."},
    {"bind", bind, METH_VARARGS,
     "bind(cls, buffer_table, /)\n--\n\nRead instances of the VirtualTensor class cls: find the slots that read() "
     "reads, and the name of nn.Module's buffer dictionary."},
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
    if (intern(&str_dtype, "dtype") || intern(&str_is_cpu, "is_cpu") || intern(&str_open_scopes, "open_scopes") || intern(&str_read, "_read") || intern(&str_converted, "_converted")) {
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
        tensor_getter("is_cpu", &get_is_cpu, &is_cpu_closure)) {
        return NULL;
    }
    PyObject *cache = PyImport_ImportModule("modattrs._cache");
    if (cache == NULL) {
        return NULL;
    }
    cache_globals = Py_NewRef(PyModule_GetDict(cache));
    Py_DECREF(cache);
    return PyModule_Create(&speedups);
}
