"""aioparamsync: an asyncio parameter server for distributed training, speaking Thrift.

async with ParameterClient("127.0.0.1:9090") as client:
    await client.update_arrays({"w": np.zeros((3, 4), np.float32)})
    arrays = await client.get_arrays(["w"])

In synchronous code (a PyTorch training loop), the same methods, blocking:
``with SyncParameterClient("127.0.0.1:9090") as client: client.get_arrays(["w"])``.

The public API is imported lazily (PEP 562): ``import aioparamsync`` loads
nothing but this file, the version and the errors, and ``aioparamsync.ParameterClient``
imports the client when first used. So the sans-IO layers
(``aioparamsync.wire``, ``aioparamsync.values``, ``aioparamsync.store.table``)
import alone, without asyncio, the client or the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First: with AIOPARAMSYNC_NO_EXT=1 it makes the package's modules load from source.
from ._ext import has_extension as has_extension
from ._version import __version__ as __version__

# The errors import nothing but the standard library's: loaded with the package.
from .errors import (
    CallTimeout,
    CheckpointError,
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    ConnectTimeout,
    ErrorCode,
    Indeterminate,
    LocalProtocolError,
    Moved,
    NetworkError,
    ParamSyncError,
    ProtocolError,
    RemoteProtocolError,
    RequestError,
    RunningLoopError,
    ServerError,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from .client.api import ParameterClient
    from .client.blocking import SyncParameterClient
    from .client.loop import run
    from .node import Node
    from .values.arrays import from_parameter, to_parameter
    from .values.rules import adagrad, adam, sgd, sum_rule
    from .wire import thrift

    Parameter = thrift.Parameter
    ParameterUpdate = thrift.ParameterUpdate
    ParameterRequest = thrift.ParameterRequest
    ParameterResponse = thrift.ParameterResponse
    Rule = thrift.Rule

__all__ = [
    "CallTimeout",
    "CheckpointError",
    "ClientClosedError",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLostError",
    "ErrorCode",
    "Indeterminate",
    "LocalProtocolError",
    "Moved",
    "NetworkError",
    "Launch",
    "Node",
    "ParamSyncError",
    "Parameter",
    "ParameterClient",
    "ParameterRequest",
    "ParameterResponse",
    "ParameterUpdate",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestError",
    "Rule",
    "RunningLoopError",
    "ServerError",
    "StaleSync",
    "SyncParameterClient",
    "__version__",
    "adagrad",
    "adam",
    "from_parameter",
    "has_extension",
    "run",
    "sgd",
    "sum_rule",
    "thrift",
    "to_parameter",
]

# Each lazy name: the module that defines it, and its name there.
_PUBLIC: dict[str, tuple[str, str]] = {
    "Launch": (".client.launch", "Launch"),
    "Node": (".node", "Node"),
    "ParameterClient": (".client.api", "ParameterClient"),
    "StaleSync": (".client.stale", "StaleSync"),
    "SyncParameterClient": (".client.blocking", "SyncParameterClient"),
    "from_parameter": (".values.arrays", "from_parameter"),
    "to_parameter": (".values.arrays", "to_parameter"),
    "run": (".client.loop", "run"),
    "adagrad": (".values.rules", "adagrad"),
    "adam": (".values.rules", "adam"),
    "sgd": (".values.rules", "sgd"),
    "sum_rule": (".values.rules", "sum_rule"),
    "thrift": (".wire", "thrift"),
}
# The IDL's main structs, as attributes of the package (thrift.Parameter, ...).
_STRUCTS = ("Parameter", "ParameterUpdate", "ParameterRequest", "ParameterResponse", "Rule")


def __getattr__(name: str) -> Any:
    """Import a public name on first use (and keep it, so this runs once per name)."""
    if name in _STRUCTS:
        from .wire import thrift

        value: Any = getattr(thrift, name)
        globals()[name] = value
        return value
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        # A subpackage or module (aioparamsync.torch, .tls, .metrics...) by attribute.
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_STRUCTS})
