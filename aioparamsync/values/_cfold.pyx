# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The rules' arithmetic, compiled: one pass over memory per fold, no temporaries.

The same contract as :func:`aioparamsync.values.rules.fold_into` for the common
case: a float32 or float64 parameter and a gradient of its dtype, both
C-contiguous (the caller checks, and folds every other case with numpy). numpy
computes a fold as a few whole-array operations, each a pass over memory into a
new temporary, and each with ~1 us of fixed cost: most of a small tensor's fold.
Here each element goes through the rule at once.

The answers are the same bits as numpy's, operation by operation: each step
below is the one numpy makes, in the same order, rounded to the array's type as
numpy rounds it (a Python float scalar is first converted to the array's type,
as numpy 2 converts it). Only a NaN's payload may differ (which NaN an operation
of two passes on is the hardware's choice, and numpy's loops order operands
their own way). Nothing is fused: ``hatch_build.py`` compiles this with
``-ffp-contract=off``, since a fused multiply-add rounds once where numpy rounds
twice. The tests compare every rule's bits with numpy's.

A gradient is read where it arrived, in the frame, and so is an updated value:
at any byte offset, by ``memcpy`` of an element (C's well-defined unaligned load,
one load instruction, vectorized); every array this module writes is new, and
aligned. :func:`fold_entries` is a push's fold of small tensors whole, checks,
arithmetic and new entries, with no Python call a tensor but the entry's.

:mod:`.rules` uses it unless the pure path is asked for (see :mod:`aioparamsync._ext`).
"""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.math cimport sqrt, sqrtf
from libc.string cimport memcpy

import math

import numpy as np

_F32, _F64 = np.dtype("<f4"), np.dtype("<f8")
_empty = np.empty

ctypedef fused real:
    float
    double

cdef enum:
    # The most arrays one fold holds (adam's: w, g, out, m, v, m_old, v_old).
    MOST = 7
    # Elements adam's two loops take at a time (its moments stay in L1 between them).
    BLOCK = 1024

cdef enum Kind:
    ADD
    SGD
    ADAM

ctypedef struct Scalars:
    # A rule's numbers, as Python computed them (converted to the arrays' type in the loops).
    double neg_lr
    double weight_decay
    bint decay  # (decided on the rule's own value: one that is 0 in float32 still decays)
    double momentum
    double beta1
    double beta2
    double sqrt_bias2
    double eps


cdef class _Arrays:
    """The buffers of one fold's arrays, held while it runs (released when dropped)."""

    cdef Py_buffer views[MOST]
    cdef int held
    cdef Py_ssize_t count
    cdef char kind  # b'f' (float32) or b'd' (float64)
    cdef bint preset  # (kind and count set by the caller: every raw input is checked)

    def __cinit__(self):
        self.held = 0
        self.preset = False

    def __dealloc__(self):
        cdef int i
        for i in range(self.held):
            PyBuffer_Release(&self.views[i])

    cdef const char* take(
        self, object array, bint writable, bint unaligned=False, bint raw=False
    ) except NULL:
        """A C-contiguous array of the fold's dtype and length (checked), held: aligned,
        unless ``unaligned`` (an input read by :func:`_get`). ``raw``: an input given as
        its bytes (any format: read as the fold's dtype), as many as the fold's arrays'."""
        if self.held == MOST:
            raise ValueError(f"a fold takes at most {MOST} arrays")
        cdef Py_buffer* view = &self.views[self.held]
        cdef int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
        if writable:
            flags |= PyBUF_WRITABLE
        PyObject_GetBuffer(array, view, flags)
        self.held += 1
        if raw and (self.held > 1 or self.preset):
            if view.len != self.count * (4 if self.kind == b'f' else 8):
                raise TypeError(
                    f"a fold's raw input has {view.len} bytes, not those of {self.count} "
                    f"elements of {chr(self.kind)}"
                )
            return <const char*>view.buf
        cdef char code = _code(view)
        if self.held == 1:
            if code == 0:
                raise TypeError(f"a fold's arrays are float32 or float64, not {_format(view)}")
            self.kind = code
            self.count = view.len // view.itemsize
        elif code != self.kind or view.len != self.count * view.itemsize:
            raise TypeError(
                f"a fold's arrays are of one dtype and length: {view.len} bytes of "
                f"{_format(view)}, after {self.count} of {chr(self.kind)}"
            )
        if not unaligned and not _aligned(view):
            raise ValueError("a fold's arrays are aligned, but its inputs w and g")
        return <const char*>view.buf


cdef char _code(Py_buffer* view):
    """b'f' or b'd' for a float32 or float64 buffer of this machine's byte order, else 0.

    numpy's format is ``f`` for an aligned array, ``=f`` for one that is not (both this
    machine's order)."""
    cdef const char* fmt = view.format
    if fmt == NULL:
        return 0
    if fmt[0] == b'=' or fmt[0] == b'@':
        fmt += 1
    if fmt[0] == b'f' and fmt[1] == 0 and view.itemsize == 4:
        return b'f'
    if fmt[0] == b'd' and fmt[1] == 0 and view.itemsize == 8:
        return b'd'
    return 0


cdef inline bint _aligned(Py_buffer* view):
    return (<size_t>view.buf) % (<size_t>view.itemsize) == 0


cdef str _format(Py_buffer* view):
    return "no format" if view.format == NULL else repr(view.format.decode("ascii", "replace"))


def all_finite(object g):
    """True if the float32 or float64 array ``g`` holds no NaN or inf."""
    cdef _Arrays a = _Arrays()
    cdef const char* p = a.take(g, False, True)
    cdef bint ok
    with nogil:
        ok = aps_finite32(p, a.count) if a.kind == b'f' else aps_finite64(p, a.count)
    return ok


cdef extern from *:
    """
    #include <stdint.h>
    #if defined(__GNUC__)
    #define APS_NOINLINE __attribute__((noinline))
    #else
    #define APS_NOINLINE
    #endif
    /* Whether every element is finite. NaN and inf have every exponent bit set, and
       then those bits plus one carry into the sign bit. Integer arithmetic, no early
       exit: a loop the compiler vectorizes. Never inlined: inlined into a large caller
       (fold_entries), GCC left it scalar, at four times the time. */
    static APS_NOINLINE int aps_finite32(const char *g, Py_ssize_t n) {
        uint32_t x, bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(&x, g + i * 4, 4);
            bad |= (x & 0x7F800000u) + 0x00800000u;
        }
        return (bad & 0x80000000u) == 0;
    }
    static APS_NOINLINE int aps_finite64(const char *g, Py_ssize_t n) {
        uint64_t x, bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(&x, g + i * 8, 8);
            bad |= (x & 0x7FF0000000000000u) + 0x0010000000000000u;
        }
        return (bad & 0x8000000000000000u) == 0;
    }
    """
    bint aps_finite32(const char* g, Py_ssize_t n) noexcept nogil
    bint aps_finite64(const char* g, Py_ssize_t n) noexcept nogil


cdef inline void _get(real* x, const char* p, Py_ssize_t i) noexcept nogil:
    """``*x = p[i]``, of an array at any byte offset."""
    memcpy(x, p + i * <Py_ssize_t>sizeof(real), sizeof(real))


def add(object w, object g, object out, bint check=False):
    """``out = w + g``.

    Each fold answers True, or with ``check``, whether every element of ``g`` is
    finite: a pass over it first, in the same call (a small fold's own cost)."""
    return _run(ADD, w, g, out, None, None, None, None, _scalars(0, 0, 0, 0, 0, 0, 0), check)


def sgd(
    object w,
    object g,
    object out,
    object buf,
    object old,
    double neg_lr,
    double weight_decay,
    double momentum,
    bint check=False,
):
    """torch.optim.SGD's step: ``out = w - lr * d`` (as ``d * -lr + w``), where
    ``d`` is the gradient ``g' = g + weight_decay * w`` (``g`` when it is 0), or
    with a momentum ``buf = momentum * old + g'`` (``buf = g'`` when ``old`` is
    None: the first step). ``buf`` is None without a momentum.
    """
    cdef Scalars s = _scalars(neg_lr, weight_decay, momentum, 0, 0, 0, 0)
    if buf is None and old is not None:
        raise ValueError("sgd's old momentum needs a buffer for the new one")
    return _run(SGD, w, g, out, buf, None, old, None, s, check)


def adam(
    object w,
    object g,
    object out,
    object m,
    object v,
    object m_old,
    object v_old,
    double neg_lr,
    double weight_decay,
    double beta1,
    double beta2,
    double sqrt_bias2,
    double eps,
    bint check=False,
):
    """torch.optim.Adam's step, with ``g' = g + weight_decay * w``:
    ``m = beta1 * m_old + (1 - beta1) * g'``, ``v = beta2 * v_old + (1 - beta2) * g'^2``
    (``m_old`` and ``v_old`` zero when None: the first step), and
    ``out = (m / (sqrt(v) / sqrt_bias2 + eps)) * neg_lr + w``, where the caller
    gives ``neg_lr = -lr / (1 - beta1^t)`` and ``sqrt_bias2 = sqrt(1 - beta2^t)``.
    """
    cdef Scalars s = _scalars(neg_lr, weight_decay, 0, beta1, beta2, sqrt_bias2, eps)
    if m is None or v is None or (m_old is None) != (v_old is None):
        raise ValueError("adam writes both moments, and reads both or neither")
    return _run(ADAM, w, g, out, m, v, m_old, v_old, s, check)


cdef Kind _rule_of(object rule, object step, Scalars* s, int* moments) except *:
    """The kind of ``rule`` (the IDL's ``Rule``) and its numbers at ``step`` (``*s``), as
    :func:`~.rules._fold_compiled` computes them (in Python's floats); ``*moments``: how
    many arrays its state keeps (0, 1 or 2). ValueError: a rule of no kind known here."""
    name = rule.kind
    decay = rule.weight_decay or 0.0
    if name == "sum":
        s[0] = _scalars(0, 0, 0, 0, 0, 0, 0)
        moments[0] = 0
        return ADD
    if name == "sgd":
        momentum = rule.momentum or 0.0
        s[0] = _scalars(-rule.lr, decay, momentum, 0, 0, 0, 0)
        moments[0] = 1 if momentum else 0
        return SGD
    if name == "adam":
        b1, b2, lr = rule.beta1, rule.beta2, rule.lr
        s[0] = _scalars(
            -(lr / (1 - b1**step)), decay, 0, b1, b2, math.sqrt(1 - b2**step), rule.eps
        )
        moments[0] = 2
        return ADAM
    raise ValueError(f"unknown rule {name!r}")


def fold_entries(
    list grads, dict entries, dict states, object origin, object max_version,
    Py_ssize_t max_name_bytes, Py_ssize_t most_bytes, object Entry, object stepped,
    object State,
):
    """A push's fold, compiled whole for each gradient of the common case: as
    :meth:`~aioparamsync.store.table.ParameterTable.fold` folds one (its checks, and
    :func:`sgd`'s, :func:`add`'s or :func:`adam`'s arithmetic, with the rule's numbers
    computed as :func:`~.rules._fold_compiled` computes them), with no Python call but
    the new ``Entry`` (and a ``State`` that keeps arrays).

    The common case: a gradient (a decoded ``Parameter``) that names a parameter of
    ``entries`` (a name of at most ``max_name_bytes``, not named before) that has a rule
    of a kind known here and a version under ``max_version``; raw (not encoded), of its
    parameter's dtype, ``"<f4"`` or ``"<f8"`` (this machine's order: the caller asks
    only on a little-endian one), and shape, fewer than ``most_bytes``; finite where
    its rule asks. ``states``: the rules' states by name (not changed here).

    Answers ``(entries by name, their states by name, rest)``: each value new bytes of
    its own, read-only, its entry's ``array`` None, its version one more, of
    ``origin``; ``rest`` the indices of the gradients not of the common case, left for
    the caller (which says what does not fit, if anything).
    """
    cdef dict made = {}
    cdef dict kept = {}
    cdef list rest = []
    cdef Scalars s
    cdef Kind kind
    cdef int moments
    cdef Py_ssize_t i, at, ndim, count, nbytes, itemsize
    cdef char code
    cdef _Arrays a
    cdef const char *pw, *pg, *n1, *n2, *o1, *o2
    cdef char* po
    cdef object g, name, entry, rule, dtype, shape, held, state, step, out, new1, new2
    cdef object old1, old2, np_dtype
    cdef object last_step = None, last_state = None  # (a push's tensors share their step)
    for at in range(len(grads)):
        g = grads[at]
        name = g.name
        entry = entries.get(name)
        if entry is None or name in made:
            rest.append(at)
            continue
        rule, dtype, shape, held = entry.rule, g.dtype, g.shape, entry.shape
        if (
            rule is None
            or entry.version >= max_version
            or g.encoding
            or g.data is None
            or entry.dtype != dtype
            or type(shape) is not list
            or type(held) is not tuple
            or len(<list>shape) != len(<tuple>held)
            or len(<str>name) * 4 > max_name_bytes
            and len((<str>name).encode()) > max_name_bytes
        ):
            rest.append(at)
            continue
        if dtype == "<f4":
            code, itemsize, np_dtype = b'f', 4, _F32
        elif dtype == "<f8":
            code, itemsize, np_dtype = b'd', 8, _F64
        else:
            rest.append(at)
            continue
        count = 1
        for i in range(len(<list>shape)):
            d = (<list>shape)[i]
            if type(d) is not int or d != (<tuple>held)[i]:
                count = -1
                break
            count *= <Py_ssize_t>d  # (the entry's: checked when it was stored)
        nbytes = count * itemsize
        if count < 0 or nbytes >= most_bytes:
            rest.append(at)
            continue
        state = states.get(name)
        step = 1 if state is None else state.step + 1
        try:
            kind = _rule_of(rule, step, &s, &moments)
            old1 = state.momentum if state is not None and moments else None
            old2 = state.variance if state is not None and moments == 2 else None
            if moments == 2 and (old1 is None) != (old2 is None):
                raise ValueError("adam reads both moments or neither")
            a = _Arrays()
            a.kind, a.count, a.preset = code, count, True
            pw = a.take(entry.data, False, True, True)
            pg = a.take(g.data, False, True, True)
        except (TypeError, ValueError, BufferError):
            rest.append(at)
            continue
        out = PyBytes_FromStringAndSize(NULL, nbytes)
        po = PyBytes_AS_STRING(out)
        if (<size_t>po) % itemsize:
            rest.append(at)  # (never on CPython: a bytes object's data is 16-byte aligned)
            continue
        new1 = _empty(held, np_dtype) if moments > 0 else None
        new2 = _empty(held, np_dtype) if moments > 1 else None
        n1 = a.take(new1, True) if new1 is not None else NULL
        n2 = a.take(new2, True) if new2 is not None else NULL
        o1 = a.take(old1, False) if old1 is not None else NULL
        o2 = a.take(old2, False) if old2 is not None else NULL
        if not _checked_fold(code, kind, pw, pg, po, n1, n2, o1, o2, &s, count,
                             not rule.allow_nonfinite):
            rest.append(at)  # (not finite: the caller's check says so)
            continue
        made[name] = Entry(
            name, memoryview(out), entry.version + 1, dtype, held, origin, rule, None
        )
        if new1 is not None:
            kept[name] = State(step, new1, new2)
        else:
            if step != last_step:
                last_step, last_state = step, stepped(step)
            kept[name] = last_state
    return made, kept, rest


cdef Scalars _scalars(
    double neg_lr, double weight_decay, double momentum, double beta1, double beta2,
    double sqrt_bias2, double eps,
):
    cdef Scalars s
    s.neg_lr = neg_lr
    s.weight_decay = weight_decay
    s.decay = weight_decay != 0
    s.momentum = momentum
    s.beta1 = beta1
    s.beta2 = beta2
    s.sqrt_bias2 = sqrt_bias2
    s.eps = eps
    return s


cdef bint _run(
    Kind kind, object w, object g, object out, object new1, object new2, object old1,
    object old2, Scalars s, bint check, bint raw=False,
) except -1:
    """Hold the arrays (None: not used), check them, and fold, without the GIL: True, or
    with ``check``, whether every element of ``g`` is finite (its own loop, before the
    fold's: one that vectorizes, as the fold's does). ``raw``: ``g`` is bytes (see
    :meth:`_Arrays.take`)."""
    cdef bint ok = True
    cdef _Arrays a = _Arrays()
    cdef const char* pw = a.take(w, False, True)
    cdef const char* pg = a.take(g, False, True, raw)
    cdef const char* po = a.take(out, True)
    cdef const char* n1 = a.take(new1, True) if new1 is not None else NULL
    cdef const char* n2 = a.take(new2, True) if new2 is not None else NULL
    cdef const char* o1 = a.take(old1, False) if old1 is not None else NULL
    cdef const char* o2 = a.take(old2, False) if old2 is not None else NULL
    with nogil:
        ok = _checked_fold(a.kind, kind, pw, pg, po, n1, n2, o1, o2, &s, a.count, check)
    return ok


cdef bint _checked_fold(
    char code, Kind kind, const char* w, const char* g, const char* out, const char* new1,
    const char* new2, const char* old1, const char* old2, Scalars* s, Py_ssize_t n,
    bint check,
) noexcept nogil:
    """Fold ``n`` elements of ``code`` (b'f' or b'd'); with ``check``, only if every
    element of ``g`` is finite: whether it was."""
    if code == b'f':
        if check and not aps_finite32(g, n):
            return False
        _fold(kind, w, g, <float*>out, <float*>new1, <float*>new2, <const float*>old1,
              <const float*>old2, s, n)
    else:
        if check and not aps_finite64(g, n):
            return False
        _fold(kind, w, g, <double*>out, <double*>new1, <double*>new2, <const double*>old1,
              <const double*>old2, s, n)
    return True


cdef void _fold(
    Kind kind, const char* w, const char* g, real* out, real* new1, real* new2,
    const real* old1, const real* old2, Scalars* s, Py_ssize_t n,
) noexcept nogil:
    if kind == ADD:
        _add(w, g, out, n)
    elif kind == SGD:
        _sgd(w, g, out, new1, old1, s, n)
    else:
        _adam(w, g, out, new1, new2, old1, old2, s, n)


cdef void _add(const char* w, const char* g, real* out, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef real wi, gi
    for i in range(n):
        _get(&wi, w, i)
        _get(&gi, g, i)
        out[i] = wi + gi


cdef void _sgd(
    const char* w, const char* g, real* out, real* buf, const real* old, Scalars* s,
    Py_ssize_t n,
) noexcept nogil:
    # Each case its own loop, with no branch in it (one that vectorizes): the flags are
    # constants in each call of the inlined loop.
    cdef real lr = <real>s.neg_lr, wd = <real>s.weight_decay, mu = <real>s.momentum
    if buf == NULL:
        if s.decay:
            _sgd_loop(w, g, out, buf, old, lr, wd, mu, n, True, False, False)
        else:
            _sgd_loop(w, g, out, buf, old, lr, wd, mu, n, False, False, False)
    elif old == NULL:
        if s.decay:
            _sgd_loop(w, g, out, buf, old, lr, wd, mu, n, True, True, False)
        else:
            _sgd_loop(w, g, out, buf, old, lr, wd, mu, n, False, True, False)
    elif s.decay:
        _sgd_loop(w, g, out, buf, old, lr, wd, mu, n, True, True, True)
    else:
        _sgd_loop(w, g, out, buf, old, lr, wd, mu, n, False, True, True)


cdef inline void _sgd_loop(
    const char* w, const char* g, real* out, real* buf, const real* old,
    real neg_lr, real weight_decay, real momentum, Py_ssize_t n,
    bint decay, bint has_buf, bint has_old,
) noexcept nogil:
    # numpy's steps (rules.fold_into), each rounded: g' = g + wd * w; buf = mu * old + g'
    # (g' on the first step); out = d * -lr + w.
    cdef Py_ssize_t i
    cdef real d, wi
    for i in range(n):
        _get(&wi, w, i)
        _get(&d, g, i)
        if decay:
            d = d + weight_decay * wi
        if has_old:
            d = momentum * old[i] + d
        if has_buf:
            buf[i] = d
        out[i] = d * neg_lr + wi


cdef inline real _sqrt(real x) noexcept nogil:
    if real is float:
        return sqrtf(x)
    else:
        return sqrt(x)


cdef void _adam(
    const char* w, const char* g, real* out, real* m, real* v, const real* m_old,
    const real* v_old, Scalars* s, Py_ssize_t n,
) noexcept nogil:
    # (one loop per case, as in _sgd)
    cdef real lr = <real>s.neg_lr, wd = <real>s.weight_decay, b1 = <real>s.beta1
    cdef real b2 = <real>s.beta2, sb2 = <real>s.sqrt_bias2, eps = <real>s.eps
    # (1 - beta) is computed as numpy's path computes it: in Python's floats
    cdef real c1 = <real>(1.0 - s.beta1), c2 = <real>(1.0 - s.beta2)
    if m_old == NULL:
        if s.decay:
            _adam_loop(w, g, out, m, v, m_old, v_old, lr, wd, b1, c1, b2, c2, sb2, eps, n,
                       True, False)
        else:
            _adam_loop(w, g, out, m, v, m_old, v_old, lr, wd, b1, c1, b2, c2, sb2, eps, n,
                       False, False)
    elif s.decay:
        _adam_loop(w, g, out, m, v, m_old, v_old, lr, wd, b1, c1, b2, c2, sb2, eps, n,
                   True, True)
    else:
        _adam_loop(w, g, out, m, v, m_old, v_old, lr, wd, b1, c1, b2, c2, sb2, eps, n,
                   False, True)


cdef inline void _adam_loop(
    const char* w, const char* g, real* out, real* m, real* v,
    const real* m_old, const real* v_old, real neg_lr, real weight_decay,
    real beta1, real one_minus_beta1, real beta2, real one_minus_beta2,
    real sqrt_bias2, real eps, Py_ssize_t n, bint decay, bint has_old,
) noexcept nogil:
    # numpy's steps (rules.fold_into), each rounded, with zeros for the first step's
    # moments, as numpy starts them (0 + -0 is 0: the zeros are added, not left out).
    # Two loops a block (each vectorizes: the compiler checks that arrays do not overlap
    # before it does, and gives up past a few pairs of them), the second reading back in
    # L1 the moments the first wrote.
    cdef Py_ssize_t i, start = 0, end
    cdef real d, wi, mo = 0, vo = 0, denom
    while start < n:
        end = min(n, start + BLOCK)
        for i in range(start, end):
            _get(&wi, w, i)
            _get(&d, g, i)
            if decay:
                d = d + weight_decay * wi
            if has_old:
                mo = m_old[i]
                vo = v_old[i]
            m[i] = beta1 * mo + one_minus_beta1 * d
            v[i] = beta2 * vo + one_minus_beta2 * (d * d)
        for i in range(start, end):
            _get(&wi, w, i)
            denom = _sqrt(v[i]) / sqrt_bias2 + eps
            out[i] = (m[i] / denom) * neg_lr + wi
        start = end
