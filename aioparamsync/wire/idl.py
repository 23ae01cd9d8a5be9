"""The IDL, loaded with thriftpy2, and what the codec needs to know of its methods."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import thriftpy2

__all__ = ["IDL_PATH", "SEED_IDL_PATH", "Method", "method", "thrift"]


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


def _methods(service: Any) -> dict[str, Method]:
    found = {}
    for name in service.thrift_services:
        args = getattr(service, f"{name}_args")
        result = getattr(service, f"{name}_result")
        oneway = bool(getattr(result, "oneway", False))
        typed = any(f[1] == "error" for f in result.thrift_spec.values())
        found[name] = Method(name, args, None if oneway else result, oneway, typed)
    return found


_METHODS = _methods(thrift.ParameterSyncService)

#: method(name): the service's method called ``name``, or None. (The dict's own
#: ``get``: looked up once or twice per call, on both sides.)
method: Callable[[str], Method | None] = _METHODS.get
