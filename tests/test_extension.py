"""The compiled fast path and the pure-Python one: which runs, and that they answer the same.

The suite runs on each path in ``.ci/run`` (the whole of it compiled, then the tests
of the wire and of calls with ``AIOPARAMSYNC_NO_EXT=1``). Here, in one process, the
compiled struct codec (``aioparamsync.wire._cbinary``) and the pure one (the code
:mod:`aioparamsync.wire.binary_codegen` makes) are run on the same messages,
valid and hostile, and must give the same bytes, the same values and the same
errors, word for word.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import struct
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_fuzz as fuzz
from codec_helpers import PROPERTY, GeneralReader, mutate, outcome
from hypothesis import example, given, settings
from hypothesis import strategies as st
from thriftpy2.thrift import TType

import aioparamsync
from aioparamsync import Node, ParameterClient, to_parameter
from aioparamsync._ext import compiled_modules, has_extension
from aioparamsync.errors import LocalProtocolError
from aioparamsync.wire import MessageType, Protocol, encode_message, method, thrift
from aioparamsync.wire import binary as codec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import hatch_build  # noqa: E402  (the list of what is compiled)

sys.path.remove(str(ROOT))


def _compiled_codec() -> Any:
    try:
        return importlib.import_module("aioparamsync.wire._cbinary")
    except ImportError:
        return None


_cbinary = _compiled_codec()
needs_codec = pytest.mark.skipif(
    _cbinary is None and not os.environ.get("AIOPARAMSYNC_REQUIRE_EXT"),
    reason="the compiled codec is not built (no compiler when installed)",
)


@contextlib.contextmanager
def running(path: str) -> Iterator[None]:
    """Run the binary codec's ``path`` ("pure" or "compiled") within the block."""
    reader, writer = codec.BinaryReader, codec.BinaryWriter
    saved = reader.read_message_begin, reader.read_struct, writer.write_struct
    if path == "pure":
        methods = codec.PURE_READ_MESSAGE_BEGIN, codec.PURE_READ_STRUCT, codec.PURE_WRITE_STRUCT
    else:
        assert _cbinary is not None, "the compiled codec is not built"
        methods = _cbinary.read_message_begin, _cbinary.read_struct, _cbinary.write_struct
    reader.read_message_begin, reader.read_struct, writer.write_struct = methods
    try:
        yield
    finally:
        reader.read_message_begin, reader.read_struct, writer.write_struct = saved


def encoded(msg: tuple[str, int, int, Any], protocol: Protocol = Protocol.BINARY) -> Any:
    """A message's bytes, or the error encoding it raised (its type and words)."""
    try:
        parts, size = encode_message(*msg, protocol)
    except LocalProtocolError as exc:
        return ("LocalProtocolError", str(exc))
    data = b"".join(bytes(p) for p in parts)
    assert len(data) == size
    return data


def both(fn: Any, *args: Any) -> tuple[Any, Any]:
    with running("pure"):
        pure = fn(*args)
    with running("compiled"):
        compiled = fn(*args)
    return pure, compiled


# -- which path runs ------------------------------------------------------------------


def test_the_path_asked_for_is_the_one_that_runs() -> None:
    if os.environ.get("AIOPARAMSYNC_NO_EXT"):
        assert not has_extension()
        importlib.import_module("aioparamsync.node")
        assert not [m for m in compiled_modules() if m != "aioparamsync.wire._cbinary"]
    elif os.environ.get("AIOPARAMSYNC_REQUIRE_EXT"):
        # (.ci/run: the extensions were built, and every one of them is what runs)
        assert has_extension()
        importlib.import_module("aioparamsync.node")
        wanted = {
            str(Path(m).with_suffix("")).replace("/", ".")
            for m in hatch_build.COMPILED_MODULES + hatch_build.CYTHON_MODULES
        }
        assert wanted <= set(compiled_modules()), sorted(wanted - set(compiled_modules()))
    else:
        assert has_extension() == (_cbinary is not None)
    assert aioparamsync.has_extension is has_extension


@needs_codec
@pytest.mark.parametrize("no_ext", ["1", "0", ""])
def test_aioparamsync_no_ext_in_the_environment_picks_the_pure_path(no_ext: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOPARAMSYNC_")}
    env["AIOPARAMSYNC_NO_EXT"] = no_ext
    script = (
        "import aioparamsync, aioparamsync.node\n"
        "from aioparamsync._ext import compiled_modules\n"
        "print(aioparamsync.has_extension(), len(compiled_modules()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    if no_ext == "1":
        assert out == ["False", "0"]
    else:
        assert out[0] == "True" and int(out[1]) >= 1


async def test_the_node_says_which_path_it_runs() -> None:
    async with Node(port=0) as node, ParameterClient(node.address) as client:
        info = await client.info()
    assert info.fast_path == ("compiled" if has_extension() else "pure")


@pytest.mark.parametrize("elements", [1 << 18, 1 << 24], ids=["whole", "partitioned"])
async def test_a_replaced_value_is_freed_at_once(elements: int) -> None:
    """Nothing on the path of an update or a read keeps a value's buffer alive once
    it is replaced: not even until a collection (a reference cycle would).

    (Compiled, ``server/handlers.py`` kept every partitioned update's buffers in
    cycles: a node receiving 64 MiB updates grew to 880 MiB. It is not compiled.)
    """
    gc.disable()
    try:
        async with Node(port=0) as node, ParameterClient(node.address) as client:
            held = []
            for i in range(4):
                await client.update_arrays({"w": np.full(elements, i, np.float32)})
                await client.get_arrays(["w"])
                buffers = []
                for name in node.table.names():
                    owner: Any = node.table.entry(name).data
                    while isinstance(owner, memoryview):
                        owner = owner.obj
                    if isinstance(owner, np.ndarray):  # (a frame's buffer, as received)
                        buffers.append(weakref.ref(owner))
                assert buffers
                held.append(buffers)
            alive = [any(ref() is not None for ref in buffers) for buffers in held]
            assert alive == [False, False, False, True]
    finally:
        gc.enable()


# -- one contract, two implementations --------------------------------------------------


@needs_codec
@settings(max_examples=40, deadline=None)
@example(sizes=[4096] * 200, seed=1)  # (a push of 200 x 4 KiB: ~830 KB)
@example(sizes=[16 * 1024 - 1] * 300, seed=2)
@given(
    sizes=st.lists(st.integers(0, 16 * 1024 - 1), min_size=1, max_size=300),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_message_of_many_small_binaries_is_written_alike_and_its_buffer_not_oversized(
    sizes: list[int], seed: int
) -> None:
    # Binaries under ZERO_COPY_MIN_BYTES are copied into the message's buffer, which the
    # compiled writer grows by half of itself past 64 KiB (up to ~4.7 MiB here): the same
    # bytes as the pure writer's, and at most about a third of its buffer spare.
    rng = np.random.default_rng(seed)
    grads = [
        to_parameter(f"t{i}", rng.integers(0, 256, n, dtype=np.uint8)) for i, n in enumerate(sizes)
    ]
    args = method("push_gradients").args(push=thrift.GradientPush(grads=grads, request_id="r"))
    msg = ("push_gradients", MessageType.CALL, 7, args)
    pure, compiled = both(encoded, msg)
    assert pure == compiled
    with running("compiled"):
        parts, size = encode_message(*msg)
    assert len(parts) == 1 and len(parts[0]) == size
    spare = sys.getsizeof(parts[0]) - sys.getsizeof(bytearray(size))
    assert spare <= size // 2 + 64, (size, spare)


@needs_codec
@PROPERTY
@given(msg=fuzz.messages())
def test_both_paths_encode_every_message_byte_for_byte(msg: tuple[str, int, int, Any]) -> None:
    pure, compiled = both(encoded, msg)
    assert pure == compiled
    # (and read it back alike: values, where the reader stopped, elements counted)
    if isinstance(pure, bytes):
        for cls in fuzz.body_classes(msg[0], msg[1]):
            a, b = both(outcome, codec.BinaryReader, pure[4:], cls, False)
            assert a == b


@needs_codec
@PROPERTY
@given(
    msg=fuzz.messages(),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=3),
    stream=st.booleans(),
)
def test_both_paths_read_mutated_messages_alike(
    msg: tuple[str, int, int, Any], cut: int | None, flips: list, stream: bool
) -> None:
    with running("pure"):
        data = encoded(msg)
    if not isinstance(data, bytes):
        return
    data = mutate(data[4:], cut, flips)
    for cls in fuzz.body_classes(msg[0], msg[1]):
        pure, compiled = both(outcome, codec.BinaryReader, data, cls, stream)
        assert pure == compiled


@needs_codec
@PROPERTY
@given(data=fuzz.hostile_bytes(), stream=st.booleans())
def test_both_paths_read_arbitrary_bytes_alike(data: bytes, stream: bool) -> None:
    for cls in fuzz.ALL_BODIES:
        pure, compiled = both(outcome, codec.BinaryReader, data, cls, stream)
        assert pure == compiled


# -- every struct of the IDL, every field set or not -----------------------------------


def _values(ttype: int, sub: Any, depth: int) -> st.SearchStrategy[Any]:
    """Values of a field of spec type ``ttype``: any the type holds, of any size."""
    if ttype == TType.BOOL:
        return st.booleans()
    if ttype == TType.BYTE:
        return st.integers(-128, 127)
    if ttype == TType.I16:
        return st.integers(-(2**15), 2**15 - 1)
    if ttype == TType.I32:
        return st.integers(-(2**31), 2**31 - 1)
    if ttype == TType.I64:
        return st.integers(-(2**63), 2**63 - 1)
    if ttype == TType.DOUBLE:
        return st.floats(allow_nan=False)
    if ttype == TType.STRING:
        return st.text(max_size=8)
    if ttype == TType.BINARY:
        return st.binary(max_size=24)
    if ttype == TType.STRUCT:
        return structs(sub, depth + 1)
    if ttype in (TType.LIST, TType.SET):
        etype, esub = sub if isinstance(sub, tuple) else (sub, None)
        elements = _values(etype, esub, depth + 1)
        return (
            st.lists(elements, max_size=3) if ttype == TType.LIST else st.sets(elements, max_size=3)
        )
    (ktype, ksub), (vtype, vsub) = (k if isinstance(k, tuple) else (k, None) for k in sub)
    return st.dictionaries(
        _values(ktype, ksub, depth + 1), _values(vtype, vsub, depth + 1), max_size=3
    )


def structs(cls: type, depth: int = 0) -> st.SearchStrategy[Any]:
    """A struct of class ``cls``: each field left out or set (deeper, fewer are set)."""
    fields = {}
    for spec in cls.thrift_spec.values():
        ttype, name = spec[0], spec[1]
        sub = spec[2] if len(spec) == 4 and ttype in (12, 13, 14, 15) else None
        value = st.deferred(lambda t=ttype, s=sub: _values(t, s, depth))
        fields[name] = st.none() if depth > 2 else st.one_of(st.none(), value)
    return st.builds(cls, **fields)


IDL_STRUCTS = [
    getattr(thrift, name)
    for name in dir(thrift)
    if isinstance(getattr(thrift, name), type) and hasattr(getattr(thrift, name), "thrift_spec")
]


@needs_codec
@PROPERTY
@given(
    data=st.data(),
    cut=st.one_of(st.none(), st.integers(0, 400)),
    flips=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)), max_size=3),
)
def test_every_struct_of_the_idl_is_written_and_read_alike(
    data: st.DataObject, cut: int | None, flips: list
) -> None:
    cls = data.draw(st.sampled_from(IDL_STRUCTS))
    body = data.draw(structs(cls))
    msg = ("m", MessageType.REPLY, 3, body)
    pure, compiled = both(encoded, msg)
    assert pure == compiled
    if isinstance(pure, bytes):
        assert (
            both(outcome, codec.BinaryReader, pure[4:], cls, False)
            == (outcome(GeneralReader, pure[4:], cls, False),) * 2
        )
        mutated = mutate(pure[4:], cut, flips)
        for stream in (False, True):
            a, b = both(outcome, codec.BinaryReader, mutated, cls, stream)
            assert a == b


_FULL_VALUES = {
    TType.BOOL: True,
    TType.BYTE: -3,
    TType.I16: -300,
    TType.I32: -70_000,
    TType.I64: -(2**40),
    TType.DOUBLE: -2.5,
    TType.STRING: "né",
    TType.BINARY: b"\x00\x01\xfe",
}


def _full_value(ttype: int, sub: Any, depth: int) -> Any:
    if ttype in _FULL_VALUES:
        return _FULL_VALUES[ttype]
    if ttype == TType.STRUCT:
        return full(sub, depth + 1)
    if ttype in (TType.LIST, TType.SET):
        etype, esub = sub if isinstance(sub, tuple) else (sub, None)
        items = [_full_value(etype, esub, depth + 1) for _ in range(2)]
        return items if ttype == TType.LIST else set(items[:1])
    (ktype, ksub), (vtype, vsub) = (k if isinstance(k, tuple) else (k, None) for k in sub)
    return {_full_value(ktype, ksub, depth + 1): _full_value(vtype, vsub, depth + 1)}


def full(cls: type, depth: int = 0) -> Any:
    """A struct of class ``cls`` with every field set (nested ones too, 3 levels deep)."""
    values = {}
    for spec in cls.thrift_spec.values():
        if depth < 3 or spec[-1] is True:
            sub = spec[2] if len(spec) == 4 and spec[0] in (12, 13, 14, 15) else None
            values[spec[1]] = _full_value(spec[0], sub, depth)
    return cls(**values)


@needs_codec
@pytest.mark.parametrize("cls", IDL_STRUCTS, ids=lambda c: c.__name__)
def test_every_byte_of_every_struct_changed_is_read_alike(cls: type) -> None:
    """Each byte of a struct with every field set, made each of a few values: the
    compiled reader answers what the pure one does (each field's every check)."""
    with running("pure"):
        data = encoded(("m", MessageType.REPLY, 3, full(cls)))
    assert isinstance(data, bytes)
    body = bytearray(data[4:])
    for where in range(len(body)):
        kept = body[where]
        for value in (0x00, 0x01, 0x02, 0x0B, 0x7F, 0x80, 0xFF):
            body[where] = value
            for stream in (False, True):
                a, b = both(outcome, codec.BinaryReader, bytes(body), cls, stream)
                assert a == b, (where, value, stream)
        body[where] = kept


def _update(**fields: Any) -> tuple[str, int, int, Any]:
    param = thrift.Parameter(name="w", data=b"\0" * 8, dtype="float32", shape=[2])
    for name, value in fields.items():
        setattr(param, name, value)
    update = thrift.ParameterUpdate(params=[param], timestamp=1)
    return "push_parameters", MessageType.CALL, 1, method("push_parameters").args(update=update)


BAD_VALUES = [
    {"name": None},  # a required field missing
    {"name": "\ud800"},  # not encodable as UTF-8
    {"name": 5},
    {"version": 2**31},
    {"version": -(2**31) - 1},
    {"version": "1"},
    {"version": 1.5},
    {"version": True},  # (an int to struct: written as 1)
    {"version": np.int64(3)},  # (an __index__: written)
    {"shape": [1, 2**63]},
    {"shape": [1, "2"]},
    {"shape": [*range(12), None]},
    {"shape": 7},
    {"shape": (3, 4)},  # (any iterable: written)
    {"scale": "x"},
    {"scale": 2},  # (an int where a double is: written)
    {"replace": 0},  # (a bool's truth: written)
    {"data": 3},
    {"data": np.zeros((2, 3), np.float32)},  # (any C-contiguous buffer: written)
    {"data": np.zeros((4, 4), np.float32)[:, 1]},
    {"data": memoryview(b"abcd")},
    {"data": bytearray(b"abcd")},
    {"data": "text"},
    {"data": b"x" * (64 * 1024)},  # (by reference)
    {"rule": "sgd"},
    {"rule": thrift.Rule(kind=None)},
    {"rule": thrift.Rule(kind="sgd", lr="fast")},
]


def _id(fields: dict[str, Any]) -> str:
    """A test id that is the same in every process (a memoryview's repr holds its address)."""
    shown = {
        k: f"memoryview({v.tobytes()!r})" if isinstance(v, memoryview) else v
        for k, v in fields.items()
    }
    return repr(shown)[:40]


@needs_codec
@pytest.mark.parametrize("fields", BAD_VALUES, ids=[_id(f) for f in BAD_VALUES])
def test_both_paths_refuse_or_write_odd_values_alike(fields: dict[str, Any]) -> None:
    pure, compiled = both(encoded, _update(**fields))
    assert pure == compiled


@needs_codec
def test_a_released_view_is_refused_alike() -> None:
    view = memoryview(b"abcd")
    view.release()
    pure, compiled = both(encoded, _update(data=view))
    assert pure == compiled and pure[0] == "LocalProtocolError"


@needs_codec
def test_maps_and_lists_of_every_kind_match() -> None:
    result = method("push_parameters").result(
        success=thrift.UpdateResult(versions={"a": 1, "b": -(2**31), "ü": 2**31 - 1}, timestamp=3)
    )
    request = thrift.ParameterRequest(
        param_names=["a", "b" * 40_000],
        known_versions={"x": 2},
        known_origins={"x": "n1"},
        wait_ms=5,
        all_names=True,
    )
    for msg in [
        ("push_parameters", MessageType.REPLY, 9, result),
        ("pull_parameters", MessageType.CALL, 9, method("pull_parameters").args(request=request)),
    ]:
        pure, compiled = both(encoded, msg)
        assert pure == compiled and isinstance(pure, bytes)
        cls = method(msg[0]).result if msg[1] == MessageType.REPLY else method(msg[0]).args
        a, b = both(outcome, codec.BinaryReader, pure[4:], cls, False)
        assert a == b and not isinstance(a[0], str)


@needs_codec
@pytest.mark.parametrize(
    "versions",
    [
        [],
        [1, -(2**31), 2**31 - 1],
        [1, 2**31],
        [-(2**31) - 1],
        [1, "2"],
        [1.5],
        [True, 2],
        [np.int32(4)],
        (3, 4),
        None,
    ],
    ids=repr,
)
def test_a_list_of_i32_is_written_and_read_alike(versions: Any) -> None:
    """(Packed.versions: the compiled writer takes ints of 32 bits; any other item, the
    pure writer's way, whatever it says.)"""
    block = thrift.Packed(
        names=["a"], dtype="<f4", shapes=[1, 1], data=b"\0" * 4, versions=versions, origins=["n"]
    )
    answer = method("pull_parameters").result(
        success=thrift.ParameterResponse(params=[], timestamp=1, packed=[block])
    )
    pure, compiled = both(encoded, ("pull_parameters", MessageType.REPLY, 9, answer))
    assert pure == compiled
    if isinstance(pure, bytes):
        cls = method("pull_parameters").result
        a, b = both(outcome, codec.BinaryReader, pure[4:], cls, False)
        assert a == b and not isinstance(a[0], str)


@needs_codec
def test_a_struct_read_by_the_compiled_path_is_the_struct_init_would_make() -> None:
    param = to_parameter("w", np.arange(3, dtype=np.float32))
    update = thrift.ParameterUpdate(params=[param], timestamp=4)
    msg = ("push_parameters", MessageType.CALL, 1, method("push_parameters").args(update=update))
    with running("pure"):
        data = encoded(msg)
    with running("compiled"):
        reader = codec.BinaryReader(data[4:])
        reader.read_message_begin()
        body = reader.read_body(method("push_parameters").args)
    got = body.update.params[0]
    made = thrift.Parameter(
        **{f[1]: getattr(got, f[1]) for f in thrift.Parameter.thrift_spec.values()}
    )
    assert vars(got) == vars(made) and list(vars(got)) == list(vars(made))
    assert got == made and type(got) is thrift.Parameter
    assert isinstance(got.data, memoryview) and got.data.readonly


@needs_codec
def test_a_message_header_is_read_alike_when_malformed() -> None:
    good = struct.pack("!Ii", 0x80010001, 4) + b"ping" + struct.pack("!i", 3) + b"\x00"
    cases = [good, good[:6], good[:11], b"\x80\x01\x00\x01\xff\xff\xff\xff", b"\x80\x02" + good[2:]]
    cases.append(struct.pack("!Ii", 0x80010001, 2) + b"\xff\xfe" + struct.pack("!i", 3) + b"\x00")
    for data in cases:
        for stream in (False, True):
            a, b = both(outcome, codec.BinaryReader, data, method("ping").args, stream)
            assert a == b
