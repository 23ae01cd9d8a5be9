"""The IDL, loaded with thriftpy2, and the method table: each method's structs and traits.

The table is the one place that says what each method of the service does
beyond its signature, for the client and the node alike:

* ``writes``: it changes the node's state. The node answers a read only after
  the writes sent before it on the same connection (read-your-writes), and
  applies one connection's writes in the order they were sent.
* ``idempotent``: sent twice, it is applied once (every read; ``push_gradients``
  by its request id). The client retries an idempotent call on a fresh
  connection when one breaks; never a write that is not.
* ``held``: the node may hold it until something happens (``barrier``
  always; a read whose request has ``wait_ms``: a long poll), so the client
  sends it on a connection of its own, not one shared with quick calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import thriftpy2

__all__ = [
    "IDL_PATH",
    "MAX_METHOD_NAME_BYTES",
    "METHODS",
    "SEED_IDL_PATH",
    "Method",
    "Methods",
    "method",
    "thrift",
]


def _find(name: str) -> Path:
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / name, here.parent / "idl" / name):  # wheel, then checkout
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"the IDL file {name} is missing from the installation")


IDL_PATH = _find("aioparamsync.thrift")
SEED_IDL_PATH = _find("ml_param_sync.thrift")

thrift: Any = thriftpy2.load(str(IDL_PATH), module_name="aioparamsync_thrift")


@dataclass(frozen=True, slots=True)
class Method:
    """One method of the service: its name and its argument and result structs."""

    name: str
    args: Any  # thriftpy2 struct classes
    result: Any  # None for oneway methods
    oneway: bool
    #: whether the result declares the typed ``ParameterError`` (field ``error``)
    typed_errors: bool = False
    #: it changes the node's state (see the module's docstring)
    writes: bool = False
    #: sent twice, it is applied once
    idempotent: bool = True
    #: "never", "always", or "wait_ms": held when its request has a ``wait_ms``
    held: str = "never"


# Each method's traits, where they are not a read's (no write, idempotent, never held).
_TRAITS: dict[str, dict[str, Any]] = {
    "update_parameters": {"writes": True, "idempotent": False},
    "push_parameters": {"writes": True, "idempotent": False},
    "broadcast_update": {"writes": True, "idempotent": False},
    "push_gradients": {"writes": True},  # idempotent by its request id
    "get_parameters": {"held": "wait_ms"},
    "pull_parameters": {"held": "wait_ms"},
    "barrier": {"held": "always"},
    "watch": {"held": "wait_ms"},
    "drain": {"held": "always", "writes": True, "idempotent": False},
    "shutdown": {"held": "always", "writes": True, "idempotent": False},
    "create_table": {"writes": True},  # the same table again is no change
    "push_row_gradients": {"writes": True},  # idempotent by its request id
    "replicate_rows": {"writes": True},  # a row kept at its version once
    "lift": {"writes": True},  # raised once: a version at its floor stays
}


def _methods(service: Any) -> dict[str, Method]:
    found = {}
    for name in service.thrift_services:
        args = getattr(service, f"{name}_args")
        result = getattr(service, f"{name}_result")
        oneway = bool(getattr(result, "oneway", False))
        typed = any(f[1] == "error" for f in result.thrift_spec.values())
        found[name] = Method(
            name, args, None if oneway else result, oneway, typed, **_TRAITS.get(name, {})
        )
    if unknown := set(_TRAITS) - set(found):
        raise RuntimeError(f"traits of methods the IDL does not have: {sorted(unknown)}")
    return found


_METHODS = _methods(thrift.ParameterSyncService)

#: The longest method name (UTF-8 bytes): a message naming a longer one is no
#: call of this service, refused once its length is read (not waited for).
MAX_METHOD_NAME_BYTES = max(len(name.encode()) for name in _METHODS)

#: method(name): the service's method called ``name``, or None. (The dict's own
#: ``get``: looked up once or twice per call, on both sides.)
method: Callable[[str], Method | None] = _METHODS.get


class Methods:
    """The service's methods as typed attributes: ``METHODS.push_parameters`` is its
    :class:`Method`. Filled from the IDL at import; a method of the IDL missing
    here, or one here the IDL lacks, fails the import."""

    get_parameters: Method
    update_parameters: Method
    broadcast_update: Method
    pull_parameters: Method
    push_parameters: Method
    ping: Method
    info: Method
    announce: Method
    digest: Method
    push_gradients: Method
    barrier: Method
    watch: Method
    topology: Method
    digest_for: Method
    lift: Method
    drain: Method
    shutdown: Method
    create_table: Method
    tables: Method
    pull_rows: Method
    push_row_gradients: Method
    replicate_rows: Method
    bucket_rows: Method
    cut: Method

    def __init__(self, methods: dict[str, Method]) -> None:
        declared = set(type(self).__annotations__)
        if declared != set(methods):
            raise RuntimeError(
                f"the method table and the IDL differ: {sorted(declared ^ set(methods))}"
            )
        for name, m in methods.items():
            setattr(self, name, m)

    def __iter__(self) -> Iterator[Method]:
        return iter(_METHODS.values())


#: The method table (see :class:`Methods`).
METHODS = Methods(_METHODS)
