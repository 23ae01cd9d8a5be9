"""Thrift's binary and compact protocols: bounds-checked, zero-copy, no I/O.

Theory of operation. A message is decoded from one contiguous buffer (a
frame's payload, or the bytes an unframed connection has received so far):
:func:`decode_header` reads its header and answers the reader that decodes
its body, every read checked against the bytes left. A message is encoded by
:func:`encode_message` into a list of buffers for a vectored write, large
``binary`` values by reference. The structs are the classes
:func:`thriftpy2.load` generates, walked by their ``thrift_spec``, so the
codec knows nothing of the IDL. The parts these two tie together:

    protocol.py        Protocol, MessageType, type codes, the binary layouts
    plan.py            each struct class's plan (its spec, normalised once)
    reader.py          Reader (the bounds, the general walk) and NeedData
    writer.py          Writer (buffers by reference, the general walk)
    binary.py          the binary protocol, which carries nearly every call
    binary_codegen.py  the code made for each struct class to read and write it
    compact.py         the compact protocol
    stream.py          StreamMeasure: where an unframed message ends

Any malformed input raises :class:`~aioparamsync.errors.RemoteProtocolError`
and nothing else; a value that cannot be encoded raises
:class:`~aioparamsync.errors.LocalProtocolError`.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import LocalProtocolError
from .binary import BinaryReader, BinaryWriter
from .compact import CompactReader, CompactWriter
from .idl import MAX_METHOD_NAME_BYTES
from .protocol import _S_I32, MAX_I32, Protocol
from .reader import NeedData, Reader
from .writer import Writer

__all__ = ["claimed_name_length", "decode_header", "encode_message"]

# (an enum's member is slow to get: bound once)
_PROTOCOL_BINARY = Protocol.BINARY

_READERS: dict[Protocol, type[Reader]] = {
    Protocol.BINARY: BinaryReader,
    Protocol.COMPACT: CompactReader,
}


def decode_header(
    payload: Any,
    protocol: Protocol,
    *,
    stream: bool = False,
    limit: int = MAX_I32,
    name_limit: int = MAX_METHOD_NAME_BYTES,
) -> tuple[str, int, int, Reader]:
    """Read a message's header: answer (name, type, seqid, reader).

    ``reader.read_body(cls)`` then decodes the struct that follows. A method
    name longer than ``name_limit`` bytes (by default, than any method of the
    IDL) is a :class:`~aioparamsync.errors.RemoteProtocolError`.
    """
    # (an enum's hash is slow: test for the usual protocol first)
    reader_cls = BinaryReader if protocol is _PROTOCOL_BINARY else _READERS[protocol]
    reader = reader_cls(payload, stream=stream, limit=limit, name_limit=name_limit)
    name, mtype, seqid = reader.read_message_begin()
    return name, mtype, seqid, reader


def claimed_name_length(begun: Any, protocol: Protocol) -> int | None:
    """The length of the method name a message starting with the bytes ``begun`` claims.

    None while ``begun`` does not hold it yet. (So a receiver can refuse a
    message naming no method before the rest of it has come.)

    Raises:
        RemoteProtocolError: the bytes before it are no header's (compact: a
            seqid longer than 5 bytes).
    """
    if protocol is _PROTOCOL_BINARY:  # (strict: the version word, then the name's length)
        return _S_I32.unpack_from(begun, 4)[0] if len(begun) >= 8 else None
    reader = _READERS[protocol](begun, stream=True)
    try:
        reader._take(2)  # (0x82, the version and the type)
        reader._varint(5)  # type: ignore[attr-defined]  # (the seqid)
        return reader._read_length()
    except NeedData:
        return None


_WRITERS: dict[Protocol, type[Writer]] = {
    Protocol.BINARY: BinaryWriter,
    Protocol.COMPACT: CompactWriter,
}


def encode_message(
    name: str,
    mtype: int,
    seqid: int,
    body: Any,
    protocol: Protocol = Protocol.BINARY,
    *,
    framed: bool = True,
) -> tuple[list[Any], int]:
    """Encode one message; answer (buffers for ``writelines``, total bytes).

    Large ``binary`` values are in the list by reference: they must not change
    until the buffers are written. A message without any is one buffer.

    Raises:
        LocalProtocolError: a value the protocol cannot carry.
    """
    writer = BinaryWriter() if protocol is _PROTOCOL_BINARY else _WRITERS[protocol]()
    if framed:
        writer.out += b"\0\0\0\0"  # the frame's length, known at the end
    try:
        writer.write_message_begin(name, mtype, seqid)
        writer.write_struct(body)
    except LocalProtocolError:
        raise
    except (struct.error, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise LocalProtocolError(f"cannot encode {name}: {exc}") from None
    parts, size = writer.getvalue()
    if framed:
        if size - 4 > MAX_I32:
            raise LocalProtocolError(f"message of {size - 4} bytes exceeds Thrift's 2 GiB frame")
        _S_I32.pack_into(parts[0], 0, size - 4)  # parts[0] starts with the 4 bytes
    return parts, size
