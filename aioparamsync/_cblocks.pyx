# cython: language_level=3
"""Large blocks of memory, kept for reuse once no one holds them.

A fold writes a new value (and ``momentum`` or ``adam`` new moments) into new
arrays, and a large frame is received into a new buffer. Over 32 MiB, such an
array from ``np.empty`` is fresh memory whatever glibc is told: ``mmap``'d, each
page zeroed by the kernel at its first write (~4 ms for 64 MiB here, against a
fold's 7 ms into memory the process has). The arrays they replace are let go
just after, and given back to the kernel.

A :class:`Block` is such memory that comes back here instead, when the last
array, view or ``memoryview`` of it is gone (its ``__dealloc__``; nothing holds
a block's memory but through the block, so then no one can read it), and the
next block of the same size is that memory again, its pages the process's
already.

What is kept is bounded twice:

* the memory of blocks live and kept never exceeds the most that blocks have
  held live at once (kept blocks are given back to the kernel before a new one
  would raise it): the process's peak is what it was without the pool;
* at most ``cap`` bytes are kept (:func:`set_cap`; :func:`trim` gives all
  back).

Blocks are for arrays of more than ``MIN_BYTES`` (``aioparamsync.blocks`` asks for no
other): glibc's ``malloc`` takes those from its heap, and a node's process keeps that memory for
reuse (``cli/memory.py``); larger ones it maps anew each time, whatever it is
told. All of this runs holding the GIL (``__dealloc__`` too), which serializes it.
"""

from cpython.buffer cimport PyBuffer_FillInfo
from posix.mman cimport (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_PRIVATE,
    PROT_READ,
    PROT_WRITE,
    madvise,
    mmap,
    munmap,
)

cdef extern from *:
    """
    #include <sys/mman.h>
    #include <unistd.h>
    #ifdef MADV_HUGEPAGE
    #define APS_MADV_HUGEPAGE MADV_HUGEPAGE
    #else
    #define APS_MADV_HUGEPAGE 0
    #endif
    """
    int APS_MADV_HUGEPAGE
    long sysconf(int name)
    int _SC_PAGESIZE

# new() makes blocks of more bytes than this: glibc's largest mmap threshold (cli/memory.py).
MIN_BYTES = 32 << 20
# At most this many bytes kept (set_cap).
DEFAULT_CAP = 512 << 20

cdef Py_ssize_t _page = sysconf(_SC_PAGESIZE)
cdef dict _kept = {}  # mapped size -> addresses (as ints) of blocks of that size, kept
cdef Py_ssize_t _live = 0  # bytes of blocks live
cdef Py_ssize_t _cached = 0  # bytes of blocks kept
cdef Py_ssize_t _peak = 0  # the most bytes of blocks live at once
cdef Py_ssize_t _cap = DEFAULT_CAP
cdef Py_ssize_t _made = 0  # blocks mapped (not reused)
cdef Py_ssize_t _reused = 0


cdef void _unmap_one() except *:
    """Give the kernel back one kept block (of the size kept longest)."""
    global _cached
    size = next(iter(_kept))
    addresses = _kept[size]
    address = addresses.pop(0)
    if not addresses:
        del _kept[size]
    _cached -= size
    munmap(<void*><size_t>address, size)


cdef char* _take(Py_ssize_t size) except NULL:
    """A block of ``size`` bytes (a whole number of pages): kept, or mapped."""
    global _cached, _live, _peak, _made, _reused
    cdef void* p
    addresses = _kept.get(size)
    if addresses:
        address = addresses.pop()
        if not addresses:
            del _kept[size]
        _cached -= size
        _live += size
        _reused += 1
        return <char*><size_t>address
    # A new block: first give back what it would raise the peak by.
    while _cached and _live + size + _cached > max(_peak, _live + size):
        _unmap_one()
    p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    while p == MAP_FAILED and _cached:
        _unmap_one()
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED:
        raise MemoryError(f"no memory for a block of {size} bytes")
    if APS_MADV_HUGEPAGE:
        madvise(p, size, APS_MADV_HUGEPAGE)  # (as numpy asks for its large arrays; a hint)
    _live += size
    _made += 1
    if _live > _peak:
        _peak = _live
    return <char*>p


cdef void _give_back(char* p, Py_ssize_t size) noexcept:
    global _cached, _live
    _live -= size
    if _kept is not None and _cached + size <= _cap:
        try:
            _kept.setdefault(size, []).append(<size_t>p)
            _cached += size
            return
        except BaseException:  # (no memory for the list's entry: give it back)
            pass
    munmap(p, size)


cdef class Block:
    """``nbytes`` bytes of writable memory, not zeroed (as ``np.empty``'s): a buffer.

    Its memory is kept for the next block of its size once the block is gone.
    """

    cdef char* _p
    cdef readonly Py_ssize_t nbytes
    cdef Py_ssize_t _mapped

    def __cinit__(self, Py_ssize_t nbytes):
        if nbytes < 1:
            raise ValueError(f"a block of {nbytes} bytes")
        self._mapped = (nbytes + _page - 1) // _page * _page
        self._p = _take(self._mapped)
        self.nbytes = nbytes

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self._p, self.nbytes, 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __dealloc__(self):
        if self._p != NULL:
            _give_back(self._p, self._mapped)
            self._p = NULL


def set_cap(Py_ssize_t cap):
    """Keep at most ``cap`` bytes of blocks no one holds (0: keep none); answer the old cap."""
    global _cap
    if cap < 0:
        raise ValueError(f"a cap of {cap} bytes")
    old, _cap = _cap, cap
    while _cached > _cap:
        _unmap_one()
    return old


def trim():
    """Give every kept block back to the kernel."""
    while _cached:
        _unmap_one()


def stats():
    """``{"live", "kept", "peak", "made", "reused"}``: bytes of blocks held, kept and the
    most held at once; blocks mapped and reused."""
    return {"live": _live, "kept": _cached, "peak": _peak, "made": _made, "reused": _reused}
