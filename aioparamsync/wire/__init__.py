"""The wire: the IDL, the codecs and the framing, with no I/O and no asyncio.

``thrift`` is the module :func:`thriftpy2.load` makes of
``idl/aioparamsync.thrift``: its classes (``thrift.Parameter``, ...) are the
messages' types.
"""

from __future__ import annotations

from .codec import decode_header, encode_message
from .framing import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_RECEIVING_BYTES,
    UNIX_SEND_BUFFER_BYTES,
    Frame,
    ReceiveBudget,
    Receiver,
)
from .idl import IDL_PATH, METHODS, SEED_IDL_PATH, Method, Methods, method, thrift
from .protocol import MessageType, Protocol
from .reader import NeedData, Reader
from .stream import StreamMeasure

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_RECEIVING_BYTES",
    "IDL_PATH",
    "METHODS",
    "SEED_IDL_PATH",
    "Frame",
    "MessageType",
    "Method",
    "Methods",
    "NeedData",
    "Protocol",
    "Reader",
    "ReceiveBudget",
    "Receiver",
    "decode_header",
    "encode_message",
    "StreamMeasure",
    "UNIX_SEND_BUFFER_BYTES",
    "method",
    "thrift",
]
