# cython: language_level=3, boundscheck=False, wraparound=False
"""Many small tensors in blocks, compiled: a push's blocks made gradients (the loop of
:func:`aioparamsync.values.packing.gradients_of`), a read's answer packed (that of
:func:`~aioparamsync.values.packing.packed_response`, :func:`packed_blocks`).

A push of 200 tensors of 4 KiB comes as one block (``GradientPush.packed``); the node
makes a ``Parameter`` of each of its gradients, a view of the block's bytes, and folds
them as if each had come so. In Python that took ~0.85 us a tensor, most of a small
tensor's fold again (``_cfold.fold_entries``, ~1.2 us). Here each is made as the
Python function makes it (the struct's defaults copied, then its name, data, dtype
and shape), in the same order, from the same walk of the block's shapes. A block
that does not add up, of a dtype that is not numeric, or in shared memory, is not
made here: :func:`gradients_of` answers None, and the Python function, walking the
blocks again, says what is wrong (its messages are the only ones). A read of the
same 200 is answered in a block made in one pass (~0.28 us a tensor against ~0.38,
a third of it the copy of its bytes into the block).
"""

from cpython.dict cimport PyDict_Copy


def gradients_of(
    list blocks, object cls, dict defaults, object itemsize_of, Py_ssize_t max_dimensions
):
    """A ``cls`` (the IDL's ``Parameter``) of each gradient of ``blocks``, each
    ``defaults`` (a copy) with its ``name``, ``data`` (a view of its block's bytes),
    ``dtype`` and ``shape`` (a list of its own); ``itemsize_of(dtype)``: the bytes of an
    element of a block's dtype (raising for one that is not numeric).

    None where a block is not of the common case (see the module): nothing is made.
    """
    cdef list made = [], names, shapes, shape
    cdef Py_ssize_t size, nbytes, at, last, offset, stop, count, ndim, d, k
    cdef object new = object.__new__, block, view, name, p, n, dtype
    cdef dict attributes
    for block in blocks:
        if block.shared is not None or type(block.names) is not list:
            return None
        if type(block.shapes) is not list:
            return None
        names, shapes, dtype = block.names, block.shapes, block.dtype
        try:
            size = itemsize_of(dtype)
            view = memoryview(block.data).cast("B")
        except Exception:  # (the Python function says what: a dtype, no data)
            return None
        nbytes = len(view)
        last = len(shapes) - 1
        at = offset = 0
        for name in names:
            if at < last and shapes[at] == 1 and type(shapes[at + 1]) is int and (
                0 <= shapes[at + 1] <= nbytes
            ):
                n = shapes[at + 1]
                count = n  # (a vector, the common case, at once)
                shape = [n]
                at += 2
            else:
                if at > last:
                    return None
                n = shapes[at]
                if type(n) is not int or not 0 <= n <= max_dimensions or at + n > last:
                    return None
                ndim = n
                shape = shapes[at + 1 : at + 1 + ndim]
                count = 1
                for k in range(ndim):
                    n = shape[k]
                    if type(n) is not int or not 0 <= n <= nbytes:
                        return None
                    d = n
                    if d and count > nbytes // d:
                        return None  # (beyond the block's bytes)
                    count *= d
                at += 1 + ndim
            stop = offset + count * size  # (count <= nbytes: checked above, no overflow)
            if stop > nbytes:
                return None
            p = new(cls)
            attributes = PyDict_Copy(defaults)
            attributes["name"] = name
            attributes["data"] = view[offset:stop]
            attributes["dtype"] = dtype
            attributes["shape"] = shape
            p.__dict__ = attributes
            made.append(p)
            offset = stop
        if at != len(shapes) or offset != nbytes:
            return None
    return made



def packed_blocks(list entries, object cls, Py_ssize_t most_bytes):
    """:func:`aioparamsync.values.packing.packed_response`'s blocks, compiled: of the
    entries (stored ones) of ``entries`` with a dtype and a shape, of fewer than
    ``most_bytes``, not a key of a partition, a ``cls`` (the IDL's ``Packed``) for each
    of their dtypes in the order first seen, each with its entries' names, shapes,
    bytes (one after another), versions and origins; and the other entries, in order.
    """
    cdef dict groups = {}
    cdef list names, shapes, versions, origins, datas, blocks = [], rest = []
    cdef tuple group
    cdef object e, dtype, shape, data, block, name
    for e in entries:
        dtype, shape, data, name = e.dtype, e.shape, e.data, e.name
        if (
            dtype is None
            or shape is None
            or type(data) is not memoryview
            or (<memoryview>data).nbytes >= most_bytes
            or "\x00" in name
        ):
            rest.append(e)
            continue
        group = groups.get(dtype)
        if group is None:
            group = groups[dtype] = ([], [], [], [], [])
        names, shapes, versions, origins, datas = group
        names.append(name)
        shapes.append(len(shape))
        shapes.extend(shape)
        versions.append(e.version)
        origins.append(e.origin)
        datas.append(data)
    for dtype, group in groups.items():
        names, shapes, versions, origins, datas = group
        block = cls(names=names, dtype=dtype, shapes=shapes, data=b"".join(datas))
        block.versions = versions
        block.origins = origins
        blocks.append(block)
    return blocks, rest
