"""Our IDL is a strict superset of the founding one: nothing of it changed."""

from __future__ import annotations

import pytest
import thriftpy2

from aioparamsync.errors import ErrorCode, Indeterminate, Moved, RequestError
from aioparamsync.wire import IDL_PATH, METHODS, SEED_IDL_PATH, Methods, method, thrift

seed = thriftpy2.load(str(SEED_IDL_PATH), module_name="seed_idl_thrift")


def _spec(cls: type) -> dict:
    """A struct's spec with classes replaced by their names (they differ between loads)."""

    def plain(value):
        if isinstance(value, type):
            return value.__name__
        if isinstance(value, tuple):
            return tuple(plain(v) for v in value)
        return value

    return {fid: plain(field) for fid, field in cls.thrift_spec.items()}


SEED_STRUCTS = ["Parameter", "ParameterUpdate", "ParameterRequest", "ParameterResponse"]


def test_every_seed_struct_keeps_its_fields() -> None:
    for name in SEED_STRUCTS:
        ours, theirs = _spec(getattr(thrift, name)), _spec(getattr(seed, name))
        for fid, field in theirs.items():
            assert ours.get(fid) == field, f"{name} field {fid} changed"
        added = set(ours) - set(theirs)
        for fid in added:
            assert ours[fid][-1] is False, f"{name} field {fid} is new and must be optional"


def test_defaults_are_unchanged() -> None:
    for name in SEED_STRUCTS:
        theirs = dict(getattr(seed, name).default_spec)
        ours = dict(getattr(thrift, name).default_spec)
        for field, default in theirs.items():
            assert ours[field] == default, f"{name}.{field} default changed"


def test_every_seed_method_keeps_its_signature() -> None:
    ours, theirs = thrift.ParameterSyncService, seed.ParameterSyncService
    assert set(theirs.thrift_services) <= set(ours.thrift_services)
    for name in theirs.thrift_services:
        assert _spec(getattr(ours, f"{name}_args")) == _spec(getattr(theirs, f"{name}_args"))
        our_result = getattr(ours, f"{name}_result")
        their_result = getattr(theirs, f"{name}_result")
        # Same result, and no exception added (a seed client would ignore it).
        assert _spec(our_result) == _spec(their_result), name
        assert getattr(our_result, "oneway", False) == getattr(their_result, "oneway", False)


# The methods without the typed error: the founding ones (a founding client would
# ignore it), and the node's own that cannot fail on their input.
UNTYPED = {"get_parameters", "update_parameters", "broadcast_update"} | {
    "ping", "info", "announce", "digest", "topology",
}  # fmt: skip


def test_new_methods_declare_the_typed_error() -> None:
    service = thrift.ParameterSyncService
    for m in METHODS:
        if m.name in UNTYPED:
            continue
        spec = getattr(service, f"{m.name}_result").thrift_spec
        assert spec[1][1] == "error" and spec[1][2] is thrift.ParameterError


def test_the_idl_file_is_the_one_loaded() -> None:
    assert IDL_PATH.name == "aioparamsync.thrift"
    assert "ParameterSyncService" in IDL_PATH.read_text()


def test_error_codes_are_the_idls() -> None:
    # errors.py sits below the wire (it imports nothing of ours): its copy must match.
    assert {c.name: c.value for c in ErrorCode} == dict(thrift.ErrorCode._NAMES_TO_VALUES)


@pytest.mark.parametrize(
    ("code", "kind"),
    [(ErrorCode.MOVED, Moved), (ErrorCode.INDETERMINATE, Indeterminate)],
)
def test_a_code_from_the_wire_is_its_own_error_type(code: ErrorCode, kind: type) -> None:
    error = RequestError.of(int(code), "said", 7)
    assert type(error) is kind and error.code == code and error.epoch == 7
    assert isinstance(error, RequestError)  # (an except RequestError still catches it)
    plain = RequestError.of(int(ErrorCode.UNAVAILABLE), "said")
    assert type(plain) is RequestError and not isinstance(plain, Indeterminate)


def test_the_method_table_covers_the_idl_and_says_what_writes() -> None:
    assert [m.name for m in METHODS] == list(thrift.ParameterSyncService.thrift_services)
    for m in METHODS:
        assert getattr(METHODS, m.name) is m is method(m.name)
    writes = {m.name for m in METHODS if m.writes}
    assert writes == {
        "update_parameters", "push_parameters", "broadcast_update", "push_gradients", "drain",
        "shutdown", "create_table", "push_row_gradients", "replicate_rows", "lift",
    }  # fmt: skip
    # never retried behind the caller's back: the writes a second delivery would apply twice
    # (a push by its request id, a table made twice, a row kept at its version and a
    # version raised to its floor are not)
    assert {m.name for m in METHODS if not m.idempotent} == writes - {
        "push_gradients", "create_table", "push_row_gradients", "replicate_rows", "lift",
    }  # fmt: skip
    assert {m.name: m.held for m in METHODS if m.held != "never"} == {
        "get_parameters": "wait_ms",
        "pull_parameters": "wait_ms",
        "barrier": "always",
        "watch": "wait_ms",
        "drain": "always",
        "shutdown": "always",
    }
    assert METHODS.broadcast_update.oneway and not METHODS.push_parameters.oneway


def test_a_method_table_that_differs_from_the_idl_fails() -> None:
    table = {m.name: m for m in METHODS}
    with pytest.raises(RuntimeError, match="differ"):
        Methods({k: v for k, v in table.items() if k != "ping"})
    with pytest.raises(RuntimeError, match="differ"):
        Methods({**table, "extra": METHODS.ping})
