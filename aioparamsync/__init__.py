"""aioparamsync: an asyncio parameter server for distributed training, speaking Thrift.

async with ParameterClient("127.0.0.1:9090") as client:
    await client.update_arrays({"w": np.zeros((3, 4), np.float32)})
    arrays = await client.get_arrays(["w"])
"""

from __future__ import annotations

__version__ = "0.1.0"

from .arrays import from_parameter, to_parameter
from .client import ParameterClient
from .errors import (
    CallTimeout,
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    ConnectTimeout,
    ErrorCode,
    LocalProtocolError,
    NetworkError,
    ParamSyncError,
    ProtocolError,
    RemoteProtocolError,
    RequestError,
    ServerError,
)
from .node import Node
from .rules import adam, sgd, sum_rule
from .wire import thrift

Parameter = thrift.Parameter
ParameterUpdate = thrift.ParameterUpdate
ParameterRequest = thrift.ParameterRequest
ParameterResponse = thrift.ParameterResponse
Rule = thrift.Rule

__all__ = [
    "CallTimeout",
    "ClientClosedError",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLostError",
    "ErrorCode",
    "LocalProtocolError",
    "NetworkError",
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
    "ServerError",
    "adam",
    "from_parameter",
    "sgd",
    "sum_rule",
    "thrift",
    "to_parameter",
]
