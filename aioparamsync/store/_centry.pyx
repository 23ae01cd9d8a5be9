# cython: language_level=3
"""New entries made by writing their slots: a store's ``Entry`` without a call to its class.

An ``Entry`` (:mod:`aioparamsync.store.table`) is a frozen dataclass with slots; its
``__init__`` sets each slot through the slot's descriptor, eight calls in a Python
frame: ~0.5 us, as much as the compiled fold of a 4 KiB gradient
(``values/_cfold.pyx``), which makes one for every gradient of a push.
:class:`EntryMaker` makes the same object (``type.__new__`` of the class, then each
slot set) by writing the slots where the class's descriptors say they are, checked
once, when the maker is made: each field a slot holding any object, and nothing
else to set (no ``__dict__``). ``Entry.__init__`` remains the definition: the tests
compare what both make.
"""

from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    PyTypeObject PyMemberDescr_Type
    object PyType_GenericAlloc(PyTypeObject *tp, Py_ssize_t nitems)
    int T_OBJECT_EX
    int READONLY

# An Entry's fields, in the order of its __init__'s arguments.
FIELDS = ("name", "data", "version", "dtype", "shape", "origin", "rule", "array")

cdef enum:
    COUNT = 8


cdef inline void _put(object made, Py_ssize_t offset, object value):
    """Set the slot at ``offset`` of ``made`` (new: it holds nothing yet) to ``value``."""
    Py_INCREF(value)
    (<PyObject **>((<char *><PyObject *>made) + offset))[0] = <PyObject *>value


cdef class EntryMaker:
    """``maker(name, data, version, dtype, shape, origin, rule=None, array=None)``: what
    ``cls(...)`` makes, for ``cls`` an ``Entry`` (see the module).

    Raises:
        TypeError: ``cls`` is not a class whose instances are just those slots.
    """

    cdef readonly object cls  # (held: the class lives as long as the maker, and tp with it)
    cdef PyTypeObject *tp
    cdef Py_ssize_t offsets[COUNT]

    def __init__(self, cls):
        if not isinstance(cls, type) or getattr(cls, "__slots__", None) != FIELDS:
            raise TypeError(f"{cls!r}: not a class of the slots {FIELDS}")
        if (<PyTypeObject *>cls).tp_dictoffset != 0 or cls.__new__ is not object.__new__:
            raise TypeError(f"{cls!r}: its objects are not made by object.__new__, slots alone")
        for i, name in enumerate(FIELDS):
            descriptor = vars(cls).get(name)
            if type(descriptor) is not <object>&PyMemberDescr_Type:
                raise TypeError(f"{cls!r}: {name!r} is not a slot")
            member = (<PyMemberDescrObject *><PyObject *>descriptor).d_member
            if member.type != T_OBJECT_EX or member.flags & READONLY:
                raise TypeError(f"{cls!r}: {name!r} is not a slot of any object")
            self.offsets[i] = member.offset
        self.cls = cls
        self.tp = <PyTypeObject *>cls

    def __call__(self, name, data, version, dtype, shape, origin, rule=None, array=None):
        made = PyType_GenericAlloc(self.tp, 0)  # (every slot NULL, as object.__new__ makes it)
        cdef Py_ssize_t *at = self.offsets
        _put(made, at[0], name)
        _put(made, at[1], data)
        _put(made, at[2], version)
        _put(made, at[3], dtype)
        _put(made, at[4], shape)
        _put(made, at[5], origin)
        _put(made, at[6], rule)
        _put(made, at[7], array)
        return made
