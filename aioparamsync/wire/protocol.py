"""What Thrift's protocols are made of, as the codec's readers and writers share it.

Which protocol a message is in (:class:`Protocol`, told by its first byte),
the message types (:class:`MessageType`), the largest i32, Thrift's type codes
as plain ints, and the fixed layouts of the binary protocol's integers,
field headers and container headers. Nothing here reads or writes.
"""

from __future__ import annotations

import enum
import struct

from thriftpy2.thrift import TType

__all__ = ["MessageType", "Protocol"]

# The largest value a Thrift i32 length may have.
MAX_I32 = 2**31 - 1


class Protocol(enum.Enum):
    """A Thrift protocol, told by a message's first byte."""

    BINARY = 0x80
    COMPACT = 0x82


class MessageType(enum.IntEnum):
    CALL = 1
    REPLY = 2
    EXCEPTION = 3
    ONEWAY = 4


# The message types as plain ints, for both sides' per-call paths (an enum's
# member is slow to get, and compares slower than an int).
CALL, REPLY, EXCEPTION, ONEWAY = (int(t) for t in MessageType)


_S_I8 = struct.Struct("!b")
_S_I16 = struct.Struct("!h")
_S_I32 = struct.Struct("!i")
_S_I64 = struct.Struct("!q")
_S_DOUBLE = struct.Struct("!d")
_S_FIELD = struct.Struct("!bh")
_S_LIST = struct.Struct("!bi")
_S_MAP = struct.Struct("!bbi")

_unpack_i16 = _S_I16.unpack_from
_unpack_i32 = _S_I32.unpack_from
_unpack_i64 = _S_I64.unpack_from
_pack_i32 = _S_I32.pack
_pack_i64 = _S_I64.pack

# TType's values, as plain ints (the walk compares them a lot).
_T_STOP = TType.STOP
_T_I32 = TType.I32
_T_I64 = TType.I64
_T_STRING = TType.STRING
_T_BINARY = TType.BINARY
_T_STRUCT = TType.STRUCT
_T_LIST = TType.LIST
_T_SET = TType.SET
_T_MAP = TType.MAP
_T_BYTES = frozenset((_T_STRING, _T_BINARY))  # both are strings on the wire
_T_SEQUENCES = frozenset((_T_LIST, _T_SET))
