"""numpy <-> Parameter: every numeric dtype and shape round-trips, without needless copies."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes  # (registers its other types, float8 and all, with numpy)
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aioparamsync import ErrorCode, RequestError, from_parameter, to_parameter
from aioparamsync.values import arrays
from aioparamsync.values.arrays import check_layout, parse_dtype, wire_dtype
from aioparamsync.wire import thrift

NUMERIC = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="="),
    hnp.unsigned_integer_dtypes(endianness="="),
    hnp.floating_dtypes(endianness="=", sizes=(16, 32, 64)),
    hnp.complex_number_dtypes(endianness="="),
    hnp.integer_dtypes(endianness=">"),
    hnp.floating_dtypes(endianness=">", sizes=(32, 64)),
)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(NUMERIC, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
def test_round_trip_is_exact(arr: np.ndarray) -> None:
    back = from_parameter(to_parameter("w", arr))
    assert back.dtype == arr.dtype
    assert back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()  # bit-exact, NaNs included


def test_contiguous_arrays_are_sent_without_a_copy() -> None:
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    param = to_parameter("w", arr)
    assert np.shares_memory(np.frombuffer(param.data, np.uint8), arr)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],
        np.arange(24, dtype=np.int16).reshape(4, 6).T,
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.arange(10, dtype=np.float16)[::-1],
    ],
)
def test_non_contiguous_arrays_round_trip(arr: np.ndarray) -> None:
    back = from_parameter(to_parameter("w", arr))
    np.testing.assert_array_equal(back, arr)
    assert back.flags.c_contiguous


def test_received_arrays_are_read_only_views() -> None:
    data = memoryview(np.arange(4, dtype=np.float32).tobytes()).toreadonly()
    param = thrift.Parameter(name="w", data=data, dtype="<f4", shape=[2, 2])
    arr = from_parameter(param)
    assert not arr.flags.writeable
    assert np.shares_memory(arr, np.frombuffer(data, np.uint8))


def test_plain_bytes_read_as_uint8_or_as_asked() -> None:
    raw = np.arange(3, dtype=np.float32).tobytes()
    param = thrift.Parameter(name="seed", data=raw)
    assert from_parameter(param).dtype == np.uint8
    np.testing.assert_array_equal(from_parameter(param, np.float32), [0, 1, 2])


def test_scalars_and_lists_are_arrays_too() -> None:
    assert from_parameter(to_parameter("s", 3.5)).item() == 3.5
    np.testing.assert_array_equal(from_parameter(to_parameter("l", [1, 2, 3])), [1, 2, 3])


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([object()]), np.zeros(2, "i4,f4")])
def test_non_numeric_arrays_are_refused(bad: np.ndarray) -> None:
    with pytest.raises(TypeError, match="cannot send"):
        to_parameter("w", bad)


def test_mismatched_parameters_raise_a_clear_error() -> None:
    param = thrift.Parameter(name="w", data=b"12345", dtype="<f4", shape=[2])
    with pytest.raises(RequestError) as info:
        from_parameter(param)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    assert "'w'" in str(info.value) and "8 bytes" in str(info.value)


def test_bfloat16_goes_on_the_wire_as_bfloat16_and_round_trips_exactly() -> None:
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16)  # every kind: normals, subnormals, inf, NaN
    arr = bits.view(ml_dtypes.bfloat16).reshape(-1, 1)
    param = to_parameter("w", arr)
    assert param.dtype == "bfloat16"  # never numpy's ambiguous "<V2"
    assert bytes(param.data) == bits.astype("<u2").tobytes()  # little-endian
    back = from_parameter(param)
    assert back.dtype == ml_dtypes.bfloat16 and back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()


def test_bfloat16_checks_layout_and_reads_plain_bytes_as_asked() -> None:
    check_layout("w", 6, "bfloat16", [3])
    with pytest.raises(RequestError, match="needs 6 bytes, got 5") as info:
        check_layout("w", 5, "bfloat16", [3])
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    bf16 = ml_dtypes.bfloat16
    raw = thrift.Parameter(name="seed", data=np.float32([1, -2]).astype(bf16).tobytes())
    np.testing.assert_array_equal(from_parameter(raw, bf16).astype(np.float32), [1, -2])


@pytest.mark.parametrize("encoding", [None, "fp16", "bf16", "int8", "topk", "zlib"])
def test_a_shape_of_no_elements_but_too_large_for_numpy_is_refused(encoding) -> None:
    # Size 0 passes every size limit; numpy still refuses the array.
    from aioparamsync.values.compression import decode

    param = thrift.Parameter(name="w", data=b"", dtype="<f4", shape=[0, 1 << 62])
    param.encoding = encoding
    with pytest.raises(RequestError, match="too large for numpy") as info:
        decode(param, max_nbytes=1 << 20) if encoding else from_parameter(param)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    empty = thrift.Parameter(name="w", data=b"", dtype="<f4", shape=[0, 5])
    assert from_parameter(empty).shape == (0, 5)  # an empty array of a sane shape is fine


@pytest.mark.parametrize("dtype", ["<V2", "|V2", "V4", "float8_e4m3fn", "<U1"])
def test_void_and_other_extension_dtypes_are_refused(dtype: str) -> None:
    param = thrift.Parameter(name="w", data=b"\0\0", dtype=dtype, shape=[1])
    with pytest.raises(RequestError) as info:
        from_parameter(param)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH


def test_importing_aioparamsync_does_not_import_ml_dtypes() -> None:
    code = "import sys, aioparamsync; sys.exit('ml_dtypes' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_wire_dtype_and_parse_dtype_agree() -> None:
    for dt in (np.dtype("<f4"), np.dtype(">i2"), np.dtype(ml_dtypes.bfloat16)):
        assert parse_dtype(wire_dtype(dt)) == dt
    assert wire_dtype(ml_dtypes.bfloat16) == "bfloat16"


def _slow_to_parameter(arr: np.ndarray) -> thrift.Parameter:
    """to_parameter by its checks (no dtype sent before: see arrays._SENT)."""
    saved = dict(arrays._SENT)
    arrays._SENT.clear()
    try:
        return to_parameter("w", arr)
    finally:
        arrays._SENT.update(saved)


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", "|i1", "|b1", "<c8", "<f2", ">u8"])
@pytest.mark.parametrize("shape", [(5,), (2, 3), (), (0,), (0, 3), (3, 0)])
def test_an_array_of_a_dtype_sent_before_goes_as_the_checks_would_send_it(dtype, shape) -> None:
    arr = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    slow = _slow_to_parameter(arr)
    to_parameter("first", arr)  # (now its dtype was sent before)
    fast = to_parameter("w", arr, version=7)
    assert (fast.name, fast.dtype, fast.shape, fast.version) == ("w", slow.dtype, slow.shape, 7)
    assert bytes(fast.data) == bytes(slow.data) == arr.tobytes()
    assert memoryview(fast.data).format == "B" and memoryview(fast.data).ndim == 1
    back = from_parameter(fast)
    assert back.dtype == arr.dtype and back.shape == arr.shape


def test_what_the_quick_way_does_not_take_goes_by_the_checks() -> None:
    to_parameter("w", np.zeros(4, np.float32))  # (float32 sent before)
    # not C-contiguous, a subclass, a list, bfloat16: each as the checks make it
    strided = np.arange(8, dtype=np.float32)[::2]
    assert bytes(to_parameter("w", strided).data) == strided.tobytes()
    sub = np.arange(4, dtype=np.float32).view(np.recarray)
    assert bytes(to_parameter("w", sub).data) == np.arange(4, dtype=np.float32).tobytes()
    assert to_parameter("w", [1.0, 2.0]).dtype == "<f8"
    b = np.ones(3, ml_dtypes.bfloat16)
    assert to_parameter("w", b).dtype == "bfloat16"
    assert to_parameter("w", b).dtype == "bfloat16"
    assert all(not arrays.is_bfloat16(d) for d in arrays._SENT)
    with pytest.raises(TypeError, match="cannot send"):
        to_parameter("w", np.array(["a"]))


@pytest.mark.parametrize(
    ("data", "shape"),
    [
        (b"12345", [2]),  # a byte short of 2 float32
        (b"123456789", [2]),  # one over
        (b"", [-1]),
        (b"1234", [2**62]),
        (b"12345678", [1]),
    ],
)
def test_a_vector_that_does_not_fit_its_bytes_is_refused_however_it_is_read(data, shape):
    parse_dtype("<f4")  # (parsed before: the quick way is open to it)
    param = thrift.Parameter(name="w", data=data, dtype="<f4", shape=shape)
    with pytest.raises(RequestError) as info:
        from_parameter(param)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    assert "'w'" in str(info.value)
