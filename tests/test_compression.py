"""Encoded parameters: each codec's error bound, hostile wire input, and error feedback."""

from __future__ import annotations

import math
import tracemalloc
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aioparamsync import ErrorCode, RequestError, adam, from_parameter, sgd, sum_rule, to_parameter
from aioparamsync.values.compression import (
    ENCODINGS,
    PULL_ENCODINGS,
    ZLIB_CHUNK,
    decode,
    decode_parameter,
    decoded_nbytes,
    encodable,
    encode,
    encoded_nbytes,
)
from aioparamsync.values.feedback import ErrorFeedback, residual_bound
from aioparamsync.wire import thrift

BF16 = np.dtype(ml_dtypes.bfloat16)

FLOATS = st.sampled_from([np.dtype("<f4"), np.dtype("<f8"), np.dtype(">f4"), np.dtype(">f8")])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)


def magnitudes(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Floats of magnitude in [lo, hi], either sign (exactly representable in float32)."""
    mag = st.floats(min_value=lo, max_value=hi, width=32)
    return st.tuples(mag, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])


def arrays_of(dtypes: st.SearchStrategy[np.dtype], elements: st.SearchStrategy[float]):
    return dtypes.flatmap(lambda dt: hnp.arrays(dt, SHAPES, elements=elements))


def round_trip(arr: np.ndarray, encoding: str, **kwargs: float) -> np.ndarray:
    param = encode("w", arr, encoding, **kwargs)
    assert param.encoding == encoding and param.shape == list(arr.shape)
    back = decode(param)
    assert back.dtype == arr.dtype and back.shape == arr.shape and back.flags.writeable
    return back


# -- error bounds ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(arrays_of(FLOATS, magnitudes(2.0**-14, 65504.0)))  # fp16's normal range
def test_fp16_relative_error_is_at_most_2_to_the_minus_11(arr: np.ndarray) -> None:
    back = round_trip(arr, "fp16")
    x = arr.astype(np.float64)
    assert np.all(np.abs(back.astype(np.float64) - x) <= 2.0**-11 * np.abs(x))


@settings(max_examples=60, deadline=None)
@given(arrays_of(FLOATS, magnitudes(2.0**-126, 2.0**127)))  # bfloat16's normal range
def test_bf16_relative_error_is_at_most_2_to_the_minus_8(arr: np.ndarray) -> None:
    back = round_trip(arr, "bf16")
    x = arr.astype(np.float64)
    assert np.all(np.abs(back.astype(np.float64) - x) <= 2.0**-8 * np.abs(x))


@settings(max_examples=80, deadline=None)
@given(
    arrays_of(
        st.sampled_from([np.dtype("<f2"), np.dtype("<f4"), np.dtype("<f8"), np.dtype(">f8")]),
        st.floats(-60000, 60000, width=16),
    )
)
def test_int8_absolute_error_is_at_most_half_the_scale(arr: np.ndarray) -> None:
    param = encode("w", arr, "int8")
    x = arr.astype(np.float64)
    amax = float(np.abs(x).max()) if x.size else 0.0
    assert param.scale == amax / 127  # scale = max|x| / 127 (an all-zero array: 0)
    assert len(param.data) == arr.size  # one byte a value
    back = decode(param).astype(np.float64)
    # scale/2 from rounding to the int8 grid, plus the cast of the product back to the dtype
    bound = param.scale / 2 * (1 + 1e-12) + np.finfo(arr.dtype).eps * np.abs(x)
    assert np.all(np.abs(back - x) <= bound)


def test_int8_keeps_its_error_bound_for_subnormal_float64_values() -> None:
    tiny = math.ulp(0.0)
    for m in (1, 190, 250, 300, 1000, 2**20):
        arr = np.array([m * tiny, -m * tiny / 2, m * tiny / 3])
        param = encode("g", arr, "int8")
        assert param.scale * 127 >= m * tiny  # it covers the largest value
        assert np.all(np.abs(decode(param) - arr) <= param.scale / 2)


def test_error_feedback_does_not_carry_what_is_not_finite() -> None:
    feedback = ErrorFeedback()
    # 1e5 is past fp16's largest (65504): sent as inf, as encode does.
    sent = feedback.encode("w", np.array([1e5, 1.0], np.float32), "fp16")
    assert np.isinf(decode(sent)[0])
    residual = feedback.residual("w")
    assert residual is not None and np.all(np.isfinite(residual))
    for _ in range(3):  # the next pushes are themselves, not -inf and then NaN
        sent = feedback.encode("w", np.array([0.5, 1.0], np.float32), "fp16")
        np.testing.assert_array_equal(decode(sent), [0.5, 1.0])


def test_int8_of_an_all_zero_array_has_scale_zero() -> None:
    param = encode("w", np.zeros((3, 2), np.float32), "int8")
    assert param.scale == 0.0
    np.testing.assert_array_equal(decode(param), np.zeros((3, 2), np.float32))


@settings(max_examples=80, deadline=None)
@given(
    arrays_of(FLOATS, st.floats(-1e6, 1e6, width=32)),
    st.floats(min_value=0.001, max_value=1.0),
)
def test_topk_keeps_exactly_the_k_largest_magnitudes(arr: np.ndarray, ratio: float) -> None:
    param = encode("w", arr, "topk", ratio=ratio)
    n = arr.size
    k = min(n, max(1, math.ceil(ratio * n)))
    idx = np.frombuffer(param.indices, "<i8")
    assert len(idx) == k and np.all(np.diff(idx) > 0)  # ascending, no repeats
    flat = arr.reshape(-1)
    assert bytes(param.data) == flat[idx].astype(flat.dtype.newbyteorder("<")).tobytes()
    dropped = np.setdiff1d(np.arange(n), idx)
    if k and len(dropped):
        assert np.abs(flat[idx]).min() >= np.abs(flat[dropped]).max()
    back = round_trip(arr, "topk", ratio=ratio).reshape(-1)
    np.testing.assert_array_equal(back[idx], flat[idx])
    assert not back[dropped].any()


ANY_NUMERIC = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="="),
    hnp.unsigned_integer_dtypes(endianness=">"),
    hnp.floating_dtypes(endianness="=", sizes=(16, 32, 64)),
    hnp.complex_number_dtypes(endianness="<"),
)
ANY_ARRAY = st.one_of(
    ANY_NUMERIC.flatmap(lambda dt: hnp.arrays(dt, SHAPES)),
    hnp.arrays(np.uint16, SHAPES).map(lambda a: a.view(BF16)),  # every bfloat16 bit pattern
)


@settings(max_examples=80, deadline=None)
@given(ANY_ARRAY, st.integers(-1, 9))
def test_zlib_is_exact_for_every_numeric_dtype(arr: np.ndarray, level: int) -> None:
    back = round_trip(arr, "zlib", level=level)
    assert back.tobytes() == arr.tobytes()  # bit for bit, NaNs included


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_bfloat16_arrays_encode_as_bfloat16(encoding: str) -> None:
    arr = np.linspace(-3, 3, 24, dtype=np.float32).astype(BF16).reshape(4, 6)
    param = encode("w", arr, encoding, ratio=1.0)
    assert param.dtype == "bfloat16"
    back = decode(param)
    assert back.dtype == BF16
    if encoding in ("bf16", "topk", "zlib"):  # exact for a bfloat16 array
        assert back.tobytes() == arr.tobytes()
    else:
        np.testing.assert_allclose(back.astype(np.float32), arr.astype(np.float32), atol=0.03)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0)])
def test_scalars_and_empty_arrays(encoding: str, shape: tuple[int, ...]) -> None:
    arr = np.full(shape, 1.5, np.float32)
    np.testing.assert_array_equal(round_trip(arr, encoding), arr)


def test_payloads_are_little_endian_whatever_the_dtype() -> None:
    arr = np.array([1.0, -2.0, 0.5, 4.0], ">f4")
    assert bytes(encode("w", arr, "fp16").data) == arr.astype("<f2").tobytes()
    topk = encode("w", arr, "topk", ratio=0.5)
    assert bytes(topk.data) == np.array([-2.0, 4.0], "<f4").tobytes()
    assert topk.indices == np.array([1, 3], "<i8").tobytes()
    assert topk.dtype == ">f4"  # the decoded array's own dtype
    bf16 = encode("w", arr, "bf16").data
    assert bytes(bf16) == arr.astype(BF16).view(np.uint16).astype("<u2").tobytes()


def test_fp16_overflow_becomes_inf_without_a_warning() -> None:
    back = round_trip(np.array([1e5, -1e6, 1.0], np.float32), "fp16")
    np.testing.assert_array_equal(back, [np.inf, -np.inf, 1.0])


def test_local_misuse_is_a_type_or_value_error() -> None:
    ints = np.arange(4, dtype=np.int32)
    for encoding in ("fp16", "bf16", "int8", "topk"):
        with pytest.raises(TypeError, match="needs a floating array"):
            encode("w", ints, encoding)
    np.testing.assert_array_equal(decode(encode("w", ints, "zlib")), ints)
    with pytest.raises(TypeError, match="cannot send"):
        encode("w", np.array(["a"]), "zlib")
    with pytest.raises(ValueError, match="unknown encoding 'lz4'"):
        encode("w", np.ones(2), "lz4")
    for ratio in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="ratio"):
            encode("w", np.ones(2), "topk", ratio=ratio)
    with pytest.raises(ValueError, match="level"):
        encode("w", np.ones(2), "zlib", level=10)
    with pytest.raises(ValueError, match="non-finite"):
        encode("w", np.array([1.0, np.nan]), "int8")


def test_encodable_and_pull_encodings() -> None:
    assert PULL_ENCODINGS == ("fp16", "bf16", "int8", "zlib")
    assert all(encodable(dt, e) for dt in ("<f2", "<f4", ">f8", "bfloat16") for e in ENCODINGS)
    assert [e for e in ENCODINGS if encodable("<i4", e)] == ["zlib"]
    assert [e for e in ENCODINGS if encodable(None, e)] == ["zlib"]
    assert not encodable("<c8", "fp16") and not encodable("<U3", "zlib")
    assert not encodable("<f16", "fp16")  # long double: zlib only
    with pytest.raises(ValueError):
        encodable("<f4", "lz4")


def test_sizes_and_the_raw_parameter() -> None:
    arr = np.arange(100, dtype=np.float32).reshape(10, 10)
    topk = encode("w", arr, "topk", ratio=0.1)
    assert encoded_nbytes(topk) == 10 * 4 + 10 * 8
    assert decoded_nbytes(topk) == 400
    raw = to_parameter("w", arr)
    assert encoded_nbytes(raw) == decoded_nbytes(raw) == 400
    view = decode(raw)  # no encoding: arrays.from_parameter's view, no copy
    assert np.shares_memory(view, np.frombuffer(raw.data, np.uint8))
    topk.version, topk.origin = 7, "n1@1"
    back = decode_parameter(topk)
    assert (back.name, back.version, back.origin, back.encoding) == ("w", 7, "n1@1", None)
    assert (back.dtype, back.shape, back.indices) == ("<f4", [10, 10], None)
    np.testing.assert_array_equal(from_parameter(back), decode(topk))
    assert decode_parameter(raw) is raw


def test_plain_bytes_in_zlib() -> None:
    blob = b"founding client bytes " * 50
    param = thrift.Parameter(name="seed", data=zlib.compress(blob), encoding="zlib")
    assert decode(param, max_nbytes=len(blob)).tobytes() == blob  # bounded by max_nbytes
    assert decoded_nbytes(param) is None
    expect_error(param, ErrorCode.SHAPE_MISMATCH, "need a shape")  # unbounded: refused
    with pytest.raises(RequestError) as info:
        decode(param, max_nbytes=len(blob) - 1)
    assert info.value.code == ErrorCode.LIMIT_EXCEEDED
    param.shape = [len(blob)]
    assert decode(param).tobytes() == blob
    raw = decode_parameter(param)
    assert (raw.dtype, raw.shape, bytes(raw.data)) == (None, [len(blob)], blob)


# -- hostile input ----------------------------------------------------------------------


def expect_error(param: object, code: ErrorCode, words: str, **kwargs: int) -> None:
    with pytest.raises(RequestError) as info:
        decode(param, **kwargs)
    assert info.value.code == code, str(info.value)
    assert words in str(info.value)
    assert "'w'" in str(info.value) or "'seed'" in str(info.value)  # names the parameter


def p(**fields: object) -> object:
    base: dict[str, object] = {"name": "w", "data": b"", "dtype": "<f4", "shape": [2]}
    base.update(fields)
    return thrift.Parameter(**base)


F4x2 = np.array([1.0, -2.0], np.float32)
IDX = np.array([0, 1], "<i8").tobytes()


@pytest.mark.parametrize(
    ("param", "code", "words"),
    [
        (p(encoding="lz4"), ErrorCode.BAD_REQUEST, "unknown encoding 'lz4'"),
        (p(encoding="FP16"), ErrorCode.BAD_REQUEST, "unknown encoding"),
        (p(encoding="fp16", dtype=None, data=b"\0" * 4), ErrorCode.SHAPE_MISMATCH, "needs a dtype"),
        (p(encoding="fp16", dtype="<U2"), ErrorCode.SHAPE_MISMATCH, "not a numeric dtype"),
        (p(encoding="zlib", dtype="<V2"), ErrorCode.SHAPE_MISMATCH, "not a numeric dtype"),
        (p(encoding="zlib", dtype="f4\x00"), ErrorCode.SHAPE_MISMATCH, "not a numpy dtype"),
        (p(encoding="fp16", data=b"\0" * 5), ErrorCode.SHAPE_MISMATCH, "needs 4 bytes, got 5"),
        (p(encoding="bf16", data=b"\0" * 2), ErrorCode.SHAPE_MISMATCH, "needs 4 bytes, got 2"),
        (p(encoding="int8", data=b"\0", scale=1.0), ErrorCode.SHAPE_MISMATCH, "needs 2 bytes"),
        (p(encoding="fp16", shape=None, data=b"\0" * 3), ErrorCode.SHAPE_MISMATCH, "whole"),
        (p(encoding="fp16", shape=[-1, -2]), ErrorCode.SHAPE_MISMATCH, "negative dimension"),
        (p(encoding="zlib", shape=[1] * 65), ErrorCode.SHAPE_MISMATCH, "dimensions"),
        (p(encoding="topk", shape=None), ErrorCode.SHAPE_MISMATCH, "needs a shape"),
        (p(encoding="fp16", dtype="<i4"), ErrorCode.BAD_REQUEST, "for floating dtypes"),
        (p(encoding="topk", dtype="<c8"), ErrorCode.BAD_REQUEST, "for floating dtypes"),
        (p(encoding="int8", dtype="<f16"), ErrorCode.BAD_REQUEST, "for floating dtypes"),
        (p(encoding="int8", data=b"\1\2"), ErrorCode.BAD_REQUEST, "scale"),
        (p(encoding="int8", data=b"\1\2", scale=-1.0), ErrorCode.BAD_REQUEST, "scale"),
        (p(encoding="int8", data=b"\1\2", scale=math.nan), ErrorCode.BAD_REQUEST, "scale"),
        (p(encoding="int8", data=b"\1\2", scale=math.inf), ErrorCode.BAD_REQUEST, "scale"),
        (p(encoding="topk", data=F4x2.tobytes()), ErrorCode.BAD_REQUEST, "needs indices"),
        (
            p(encoding="topk", data=F4x2.tobytes(), indices=IDX[:-1]),
            ErrorCode.BAD_REQUEST,
            "not a whole number of int64",
        ),
        (
            p(encoding="topk", data=F4x2[:1].tobytes(), indices=IDX),
            ErrorCode.BAD_REQUEST,
            "2 indices need 8 bytes of values, got 4",
        ),
        (
            p(encoding="topk", data=np.zeros(3, "f4").tobytes(), indices=IDX + IDX[:8]),
            ErrorCode.BAD_REQUEST,
            "3 indices for 2 elements",
        ),
        (
            p(encoding="topk", data=F4x2.tobytes(), indices=np.array([-1, 1], "<i8").tobytes()),
            ErrorCode.BAD_REQUEST,
            "negative index",
        ),
        (
            p(encoding="topk", data=F4x2.tobytes(), indices=np.array([0, 2], "<i8").tobytes()),
            ErrorCode.BAD_REQUEST,
            "index 2 out of range for 2",
        ),
        (
            p(encoding="topk", data=F4x2.tobytes(), indices=np.array([1, 1], "<i8").tobytes()),
            ErrorCode.BAD_REQUEST,
            "repeated or not in ascending order",
        ),
        (
            p(encoding="topk", data=F4x2.tobytes(), indices=np.array([1, 0], "<i8").tobytes()),
            ErrorCode.BAD_REQUEST,
            "repeated or not in ascending order",
        ),
        (
            p(
                encoding="topk",
                data=F4x2[:1].tobytes(),
                indices=np.array([2**63 - 1], "<i8").tobytes(),
            ),
            ErrorCode.BAD_REQUEST,
            "out of range",
        ),
        (p(encoding="zlib", data=b"not zlib at all"), ErrorCode.BAD_REQUEST, "corrupt"),
        (p(encoding="zlib", data=b""), ErrorCode.BAD_REQUEST, "truncated"),
        (
            p(encoding="zlib", data=zlib.compress(F4x2.tobytes())[:-3]),
            ErrorCode.BAD_REQUEST,
            "truncated",
        ),
        (
            p(encoding="zlib", data=zlib.compress(F4x2.tobytes()) + b"\0"),
            ErrorCode.BAD_REQUEST,
            "bytes after its end",
        ),
        (
            p(encoding="zlib", data=zlib.compress(b"\0" * 7)),
            ErrorCode.SHAPE_MISMATCH,
            "inflates to 7 bytes; shape (2,) of <f4 needs 8",
        ),
        (
            p(encoding="zlib", data=zlib.compress(b"\0" * 9)),
            ErrorCode.SHAPE_MISMATCH,
            "inflates to more than the 8 bytes",
        ),
    ],
)
def test_hostile_parameters_are_refused_with_a_clear_error(
    param: object, code: ErrorCode, words: str
) -> None:
    expect_error(param, code, words)


def test_max_nbytes_bounds_the_decoded_array() -> None:
    param = encode("w", np.zeros(1000, np.float32), "zlib")
    words = "decodes to 4000 bytes; at most 3999"
    expect_error(param, ErrorCode.LIMIT_EXCEEDED, words, max_nbytes=3999)
    assert decode(param, max_nbytes=4000).shape == (1000,)


def test_a_zlib_bomb_costs_no_more_than_the_array() -> None:
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros in ~64 KB
    param = p(encoding="zlib", data=bomb, shape=[1000])
    tracemalloc.start()
    try:
        expect_error(param, ErrorCode.SHAPE_MISMATCH, "inflates to more than the 4000 bytes")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * ZLIB_CHUNK


def test_zlib_decodes_across_many_chunks() -> None:
    # ~3 MiB of random floats: incompressible, so the input spans several chunks as well
    arr = np.random.default_rng(1).standard_normal(3 * ZLIB_CHUNK // 8 + 5)
    param = encode("w", arr, "zlib", level=0)
    assert encoded_nbytes(param) > arr.nbytes  # stored blocks: input as large as the output
    np.testing.assert_array_equal(decode(param), arr)


WIRE_DTYPES = ["<f4", ">f8", "<f2", "bfloat16", "<i4", "|b1", "<c8", "<U2", "<V2", "x", None]


def encoded_example(arr: np.ndarray, encoding: str, **kwargs: float):
    """An ``@example`` of what ``encode`` sends: it decodes, so the assertions run."""
    param = encode("w", arr, encoding, **kwargs)
    return example(
        encoding=param.encoding,
        dtype=param.dtype,
        shape=param.shape,
        data=bytes(param.data),
        scale=param.scale,
        indices=param.indices,
    )


@settings(max_examples=300, deadline=None)
@encoded_example(np.arange(6, dtype="<f4").reshape(2, 3), "fp16")
@encoded_example(np.linspace(-1, 1, 4, dtype=">f8"), "bf16")
@encoded_example(np.arange(6, dtype="<f4").reshape(3, 2) - 2.5, "int8")
@encoded_example(np.arange(6, dtype=">f8"), "topk", ratio=0.5)
@encoded_example(np.arange(6, dtype="<i4").reshape(1, 2, 3), "zlib")
@given(
    encoding=st.sampled_from([*ENCODINGS, "", "raw", "ZLIB"]),
    dtype=st.sampled_from(WIRE_DTYPES),
    shape=st.one_of(st.none(), st.lists(st.integers(-2, 5), max_size=3)),
    data=st.binary(max_size=64),
    scale=st.one_of(st.none(), st.floats()),
    indices=st.one_of(st.none(), st.binary(max_size=40)),
)
def test_any_wire_input_decodes_to_its_layout_or_raises_a_request_error(
    encoding: str,
    dtype: str | None,
    shape: list[int] | None,
    data: bytes,
    scale: float | None,
    indices: bytes | None,
) -> None:
    fields = {"dtype": dtype, "shape": shape, "scale": scale, "indices": indices}
    param = thrift.Parameter(name="w", data=data, encoding=encoding, **fields)
    try:
        arr = decode(param, max_nbytes=1 << 16)
    except RequestError:
        return
    if dtype is not None and shape is not None:
        assert arr.shape == tuple(shape)
    if encoding and dtype is not None:
        assert arr.flags.writeable
        assert arr.nbytes == decoded_nbytes(param)


# -- error feedback ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("encoding", "dtype", "atol"),
    [
        ("topk", np.float32, 1e-4),
        ("int8", np.float32, 1e-4),
        ("fp16", np.float32, 1e-4),
        ("bf16", np.float32, 1e-4),
        ("topk", np.float16, 1e-2),  # float16 gradients, float32 residuals
        ("topk", np.float64, 1e-10),
        ("topk", BF16, 1e-2),
    ],
)
def test_error_feedback_sends_the_gradients_sum_minus_the_last_residual(
    encoding: str, dtype: np.dtype, atol: float
) -> None:
    rng = np.random.default_rng(7)
    feedback = ErrorFeedback()
    grads = sent = np.zeros((20, 30))
    for _ in range(50):
        g = rng.standard_normal((20, 30)).astype(dtype)
        # max_residual=1: top-k sends exactly the ratio (its bound is tested below).
        param = feedback.encode("w", g, encoding, ratio=0.05, max_residual=1.0)
        assert param.dtype == to_parameter("g", g).dtype and param.shape == [20, 30]
        grads = grads + g.astype(np.float64)
        sent = sent + decode(param).astype(np.float64)
    residual = feedback.residual("w")
    assert residual is not None
    assert residual.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert np.abs(residual).max() > 0  # the identity below is not trivially 0 = 0
    np.testing.assert_allclose(sent + residual, grads, rtol=0, atol=atol)


def test_error_feedback_bookkeeping() -> None:
    feedback = ErrorFeedback()
    assert feedback.residual("w") is None and feedback.nbytes == 0
    feedback.encode("w", np.ones((4, 5), np.float32), "topk", ratio=0.1, max_residual=1.0)
    feedback.encode("b", np.ones(3), "zlib")
    assert sorted(feedback.names) == ["b", "w"]
    assert feedback.nbytes == 4 * 5 * 4 + 3 * 8
    assert repr(feedback) == "<ErrorFeedback [2 residuals, 104 bytes]>"
    np.testing.assert_array_equal(feedback.residual("b"), np.zeros(3))  # zlib is exact
    residual = feedback.residual("w")
    assert residual is not None and residual.sum() == 18  # two of twenty sent
    residual[:] = 0  # a copy: the kept residual is unchanged
    assert feedback.residual("w").sum() == 18  # type: ignore[union-attr]
    # A new shape starts over: nothing of the old residual is added.
    sent = feedback.encode("w", np.ones(6, np.float32), "topk", ratio=1.0)
    np.testing.assert_array_equal(decode(sent), np.ones(6))
    feedback.reset("w")
    assert feedback.names == ("b",)
    feedback.reset()
    assert feedback.nbytes == 0
    with pytest.raises(TypeError, match="floating gradient"):
        feedback.encode("i", np.arange(3), "topk")


def sgd_excess_loss(seed: int, mode: str, steps: int = 300) -> float:
    """Minibatch SGD on least squares; final loss minus the least-squares optimum."""
    rng = np.random.default_rng(seed)
    m, d, batch, ratio = 400, 100, 32, 0.05
    a = rng.standard_normal((m, d)).astype(np.float32)
    b = a @ rng.standard_normal(d).astype(np.float32) + 0.1 * rng.standard_normal(m).astype(
        np.float32
    )
    # lr = 0.1 / L: error feedback delays part of each gradient by ~1/ratio steps, and
    # needs a step small enough for that delay (0.5 / L makes it diverge).
    lr = 0.1 / np.linalg.eigvalsh(a.T @ a / m).max()
    w = np.zeros(d, np.float32)
    feedback = ErrorFeedback()
    batches = np.random.default_rng(seed + 1000)  # the same minibatches for every mode
    for _ in range(steps):
        rows = batches.integers(0, m, batch)
        g = a[rows].T @ (a[rows] @ w - b[rows]) / batch
        if mode == "feedback":
            g = decode(feedback.encode("w", g, "topk", ratio=ratio))
        elif mode == "topk":
            g = decode(encode("w", g, "topk", ratio=ratio))
        w -= lr * g
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    best = np.linalg.lstsq(a64, b64, rcond=None)[0]
    loss = lambda v: float(np.mean((a64 @ v - b64) ** 2) / 2)  # noqa: E731
    return loss(w.astype(np.float64)) - loss(best)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_sgd_with_error_feedback_matches_uncompressed_and_without_it_falls_behind(
    seed: int,
) -> None:
    # Loss at w = 0 is ~40-60 above the optimum. Over 30 seeds (300 steps): uncompressed
    # and feedback end within 8e-5 of each other; topk without feedback >= 0.24 behind.
    plain = sgd_excess_loss(seed, "plain")
    feedback = sgd_excess_loss(seed, "feedback")
    topk = sgd_excess_loss(seed, "topk")
    assert plain < 0.01  # converged (to SGD's noise floor)
    assert feedback - plain < 1e-3
    assert topk - plain > 0.05  # 5% of the coordinates a step: far behind at equal steps
    assert topk > 20 * feedback


# -- top-k's residual bound ---------------------------------------------------------------


def test_the_residual_bound_follows_the_rule() -> None:
    assert residual_bound(sum_rule()) == 0.5
    assert residual_bound(sgd(0.1)) == 0.5
    assert residual_bound(sgd(0.1, momentum=0.9)) == pytest.approx(0.05)
    assert residual_bound(adam(0.01, betas=(0.8, 0.999))) == pytest.approx(0.1)
    assert residual_bound(None) == pytest.approx(0.05)  # not known: as momentum 0.9


@pytest.mark.parametrize("bound", [0.5, 0.3, 0.2])
def test_bounded_top_k_holds_back_at_most_its_bound_of_the_norm(bound: float) -> None:
    # Heavy-tailed values (a few large, most small): top-k stays sparse.
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(10_000) * rng.pareto(3.0, 10_000)).astype(np.float32)
    feedback = ErrorFeedback()
    sent = feedback.encode("w", g, "topk", ratio=0.0001, max_residual=bound)
    assert sent.encoding == "topk"
    residual = feedback.residual("w")
    assert residual is not None
    assert np.linalg.norm(residual) <= bound * np.linalg.norm(g) * (1 + 1e-6)
    k = len(sent.indices) // 8
    assert 1 < k < 10_000 / 3  # more than the ratio, fewer than raw would cost
    # ... and close to the fewest: one value fewer would break the bound.
    mags = np.sort(np.abs(g.astype(np.float64)))[::-1]
    assert np.sqrt(np.sum(mags[k - 1 :] ** 2)) > bound * np.linalg.norm(g)
    info = feedback.sent("w")
    assert info is not None and info.share == k / 10_000 and info.bound == bound


def test_top_k_goes_raw_where_it_would_be_larger_than_the_array() -> None:
    # Dense values and a tight bound: most of them are needed, and 8 bytes of index
    # each would make top-k larger than the raw float32 array.
    g = np.random.default_rng(4).standard_normal(1000).astype(np.float32)
    feedback = ErrorFeedback()
    sent = feedback.encode("w", g, "topk", ratio=0.01, max_residual=0.05)
    assert not sent.encoding and sent.dtype == "<f4"
    np.testing.assert_array_equal(decode(sent), g)
    np.testing.assert_array_equal(feedback.residual("w"), np.zeros(1000))
    assert feedback.sent("w").share == 1.0  # type: ignore[union-attr]


def test_a_growing_norm_tightens_the_bound_and_it_relaxes_back() -> None:
    rng = np.random.default_rng(5)
    feedback = ErrorFeedback()
    g = (rng.standard_normal(5000) * rng.pareto(1.2, 5000)).astype(np.float32)
    feedback.encode("w", g, "topk", ratio=0.001, rule=sgd(0.1))
    assert feedback.sent("w").bound == 0.5  # type: ignore[union-attr]
    feedback.encode("w", 10 * g, "topk", ratio=0.001, rule=sgd(0.1))  # 10x larger: diverging?
    assert feedback.sent("w").bound == 0.25  # type: ignore[union-attr]
    bounds = []
    for _ in range(30):
        feedback.encode("w", 0.01 * g, "topk", ratio=0.001, rule=sgd(0.1))
        bounds.append(feedback.sent("w").bound)  # type: ignore[union-attr]
    assert bounds == sorted(bounds) and bounds[-1] == 0.5
    # A bound given for one push (everything: 0) is not carried on to the next.
    feedback.encode("w", g, "topk", ratio=0.001, max_residual=0.0)
    feedback.encode("w", 0.01 * g, "topk", ratio=0.001, rule=sgd(0.1))
    assert feedback.sent("w").bound == 0.5  # type: ignore[union-attr]


def test_sparsity_warm_up_starts_at_a_quarter_and_falls_to_the_ratio() -> None:
    rng = np.random.default_rng(6)
    feedback = ErrorFeedback()
    shares = []
    for _ in range(12):
        g = (rng.standard_normal(4000) * rng.pareto(1.2, 4000)).astype(np.float32)
        feedback.encode("w", g, "topk", ratio=0.01, max_residual=1.0, warmup=10)
        shares.append(feedback.sent("w").share)  # type: ignore[union-attr]
    assert shares[0] == 0.25 and shares == sorted(shares, reverse=True)
    assert shares[9] > 0.01 and shares[10] == shares[11] == 0.01


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_residual": 1.5}, "max_residual must be in"),
        ({"max_residual": -0.1}, "max_residual must be in"),
        ({"warmup": -1}, "warmup is a number"),
        ({"warmup": 2.5}, "warmup is a number"),
        ({"warmup": True}, "warmup is a number"),
        ({"ratio": 0.0}, "ratio must be in"),
    ],
)
def test_bad_top_k_arguments_are_refused_and_keep_the_residual(kwargs: dict, match: str) -> None:
    feedback = ErrorFeedback()
    feedback.encode("w", np.ones(10, np.float32), "topk", ratio=0.1, max_residual=1.0)
    before = feedback.residual("w")
    with pytest.raises(ValueError, match=match):
        feedback.encode("w", np.ones(10, np.float32), "topk", **({"ratio": 0.1} | kwargs))
    np.testing.assert_array_equal(feedback.residual("w"), before)
