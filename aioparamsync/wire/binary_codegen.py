"""The code made for each struct class to read and write it in the binary protocol.

In the binary protocol, which carries nearly every call, each struct class
gets code made for it on first use: a reader that takes the fields in id
order straight through, leaving anything unusual (a field out of order,
unknown, repeated, malformed or cut short) to the general walk from there,
so that its outcome is the general walk's; and a writer with the field
headers packed once. Only our own constants go into that code; names and
sub-specs are its bound values, never its text. :meth:`BinaryReader.read_struct
<.binary.BinaryReader.read_struct>` and :meth:`BinaryWriter.write_struct
<.binary.BinaryWriter.write_struct>` look the code up in the tables here.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import LocalProtocolError, RemoteProtocolError
from .plan import _plan, _wire_type
from .protocol import (
    _S_FIELD,
    _S_LIST,
    _S_MAP,
    _T_BINARY,
    _T_BYTES,
    _T_I32,
    _T_I64,
    _T_LIST,
    _T_MAP,
    _T_SEQUENCES,
    _T_STRING,
    _T_STRUCT,
    _pack_i32,
    _pack_i64,
    _unpack_i32,
    _unpack_i64,
)
from .reader import MAX_DEPTH
from .writer import ZERO_COPY_MIN_BYTES

if TYPE_CHECKING:
    from .binary import BinaryReader, BinaryWriter

# The file names of the code made here, as tracebacks and profiles show them.
_READER_FILE = "<aioparamsync.wire.binary_codegen: binary struct reader>"
_WRITER_FILE = "<aioparamsync.wire.binary_codegen: binary struct writer>"

# ---------------------------------------------------------------------------
# Reading

_S_HEAD_I32 = struct.Struct("!bhi")  # a field header and the 4 bytes after it
_S_HEAD_I64 = struct.Struct("!bhq")  # a field header and the 8 bytes after it
_S_HEAD_LIST = struct.Struct("!bhbi")  # a field header and a list's header
_S_HEAD_MAP = struct.Struct("!bhbbi")  # a field header and a map's header
# Lists of a few i64 (shapes), by count: unpacked without making a format each time.
_UNPACK_I64S = [struct.Struct(f"!{n}q").unpack_from for n in range(9)]


_BINARY_READERS: dict[Any, Callable[[BinaryReader], Any]] = {}


def _binary_reader_of(cls: Any) -> Callable[[BinaryReader], Any]:
    read = _BINARY_READERS.get(cls)
    if read is None:
        read = _BINARY_READERS[cls] = _binary_reader(cls)
    return read


def _lazy_reader(env: dict[str, Any], key: str, cls: Any) -> Callable[[BinaryReader], Any]:
    """A stand-in for the reader of ``cls`` in ``env[key]``: on its first call it
    puts the real one there (made then, so that recursive structs are no problem)."""

    def first_call(reader: BinaryReader) -> Any:
        read = env[key] = _binary_reader_of(cls)
        return read(reader)

    return first_call


def _binary_reader(cls: Any) -> Callable[[BinaryReader], Any]:
    """Make the code that reads a struct of class ``cls`` (BinaryReader.read_struct).

    It expects each field in id order and reads it in place when its header
    is there and its bytes are all there; else it moves on to the next one.
    A STOP after a field ends the struct at once (the fields after it are
    absent). Whatever it does not read (it never reads past ``end``, and
    breaks off on a bad length or invalid UTF-8) the general walk reads from
    there, so the outcome is the general walk's. Names and sub-specs are the
    code's constants, never its text. A nested struct is read by its class's
    own code, called directly.
    """
    plan = _plan(cls)
    env: dict[str, Any] = {
        "CLS": cls,
        "MAX_DEPTH": MAX_DEPTH,
        "RemoteProtocolError": RemoteProtocolError,
        "BY_ID": plan.by_id,
        "U_BH": _S_FIELD.unpack_from,  # a field header
        "U_BHI": _S_HEAD_I32.unpack_from,
        "U_BHQ": _S_HEAD_I64.unpack_from,
        "U_BHBI": _S_HEAD_LIST.unpack_from,
        "U_BHBBI": _S_HEAD_MAP.unpack_from,
        "U_I": _unpack_i32,
        "U_Q": _unpack_i64,
        "U_QS": _UNPACK_I64S,
        "UNPACK": struct.unpack_from,
    }
    code = [
        "def read(self):",
        "    depth = self.depth + 1",
        "    if depth > MAX_DEPTH:",
        "        raise RemoteProtocolError(DEEP)",
        "    self.depth = depth",
        "    buf = self.buf",
        "    end = self.end",
        "    pos = self.pos",
        "    values = {}",
        "    while True:  # once: a break goes on to the general walk",
    ]
    env["DEEP"] = f"message nests deeper than {MAX_DEPTH} levels"
    # The end: a STOP, read here; else (and after any break) the general walk.
    finish = ["{}self.depth = depth - 1"]
    for i, name in enumerate(plan.required):
        env[f"R{i}"], env[f"MISSING{i}"] = name, f"required field {cls.__name__}.{name} is missing"
        finish += [f"{{}}if R{i} not in values:", f"{{}}    raise RemoteProtocolError(MISSING{i})"]
    finish += ["{}return CLS(**values)"]
    # After a field: a STOP ends the struct (no need to look for the fields after it).
    stop_after = [
        "                if pos < end and buf[pos] == 0:",
        "                    self.pos = pos + 1",
        *(line.format(" " * 20) for line in finish),
    ]
    for i, (name, fid, ttype, sub, _, header) in enumerate(plan.in_order):
        if header is None:
            continue  # not a binary field header: the general walk's
        fid, ttype, wire = int(fid), int(ttype), int(_wire_type(ttype))
        env[f"N{i}"], env[f"S{i}"] = name, sub
        match = f"            if f == {fid} and w == {wire}:"
        if ttype in _T_BYTES:
            code += [
                "        if pos + 7 <= end:",
                "            w, f, n = U_BHI(buf, pos)",
                match,
                "                p = pos + 7",
                "                if n < 0 or p + n > end:",
                "                    break",
            ]
            if ttype == _T_BINARY:
                code += [f"                values[N{i}] = buf[p : p + n]"]
            else:
                code += [
                    "                try:",
                    f"                    values[N{i}] = str(buf[p : p + n], 'utf-8')",
                    "                except UnicodeDecodeError:",
                    "                    break",
                ]
            code += ["                pos = p + n"]
        elif ttype in (_T_I32, _T_I64):
            size, unpack = (7, "U_BHI") if ttype == _T_I32 else (11, "U_BHQ")
            code += [
                f"        if pos + {size} <= end:",
                f"            w, f, n = {unpack}(buf, pos)",
                match,
                f"                values[N{i}] = n",
                f"                pos += {size}",
            ]
        elif ttype == _T_LIST and sub[0] in (_T_I64, _T_STRUCT):
            # The list's header too, then as BinaryReader._read_list reads it
            # (the same checks, in the same order); any other list, its way.
            etype, esub, ewire = sub
            code += [
                "        if pos + 8 <= end:",
                "            w, f, e, count = U_BHBI(buf, pos)",
                f"            if f == {fid} and w == {wire} and e == {int(ewire)} and count >= 0 "
                "and depth < MAX_DEPTH:",
                "                self.pos = pos + 8",
            ]
            if etype == _T_I64:
                code += [
                    "                self._check_count_of(count, 8)",
                    "                pos += 8",
                    "                if pos + 8 * count > end:",
                    "                    self._overrun(8 * count)",
                    "                if count < 9:",
                    f"                    values[N{i}] = list(U_QS[count](buf, pos))",
                    "                else:",
                    f"                    values[N{i}] = list(UNPACK(f'!{{count}}q', buf, pos))",
                    "                pos += 8 * count",
                ]
            else:
                env[f"RS{i}"] = _lazy_reader(env, f"RS{i}", esub)
                code += [
                    "                self._check_count_of(count, 1)",
                    "                self.depth = depth + 1",
                    "                if count == 1:",
                    f"                    values[N{i}] = [RS{i}(self)]",
                    "                else:",
                    f"                    values[N{i}] = [RS{i}(self) for _ in range(count)]",
                    "                self.depth = depth",
                    "                pos = self.pos",
                ]
        elif ttype == _T_LIST and sub[0] == _T_STRING:
            # e.g. names: the list's header too, then as BinaryReader._read_list
            # reads it (the same checks, in the same order); it breaks off where
            # that would raise.
            code += [
                "        if pos + 8 <= end:",
                "            w, f, e, count = U_BHBI(buf, pos)",
                f"            if f == {fid} and w == {wire} and count >= 0 and depth < MAX_DEPTH "
                f"and (not count or e == {int(sub[2])}):",
                "                self.pos = pos + 8",
                "                self._check_count_of(count, 4)",
                "                p = pos + 8",
                "                found = []",
                "                for _ in range(count):",
                "                    if p + 4 > end:",
                "                        break",
                "                    n = U_I(buf, p)[0]",
                "                    p += 4",
                "                    if n < 0 or p + n > end:",
                "                        break",
                "                    try:",
                "                        found.append(str(buf[p : p + n], 'utf-8'))",
                "                    except UnicodeDecodeError:",
                "                        break",
                "                    p += n",
                "                else:",
                f"                    values[N{i}] = found",
                "                    pos = p",
                "                if pos != p:  # (the general walk counts them again)",
                "                    self.elements -= count",
                "                    break",
            ]
        elif (
            ttype == _T_MAP
            and sub[0] == _T_STRING
            and sub[3] in (_T_I32, _T_I64)
            and -128 <= int(sub[2]) < 128
            and -128 <= int(sub[5]) < 128
        ):
            # e.g. versions by name: the map's header too, then as
            # BinaryReader._read_map reads it (the same checks, in the same
            # order); it breaks off where that would raise.
            _, _, kwire, vtype, _, vwire = sub
            size, unpack = (4, "U_I") if vtype == _T_I32 else (8, "U_Q")
            code += [
                "        if pos + 9 <= end:",
                "            w, f, kw, vw, count = U_BHBBI(buf, pos)",
                f"            if f == {fid} and w == {wire} and count >= 0 and depth < MAX_DEPTH "
                f"and (not count or (kw == {int(kwire)} and vw == {int(vwire)})):",
                "                self.pos = pos + 9",
                f"                self._check_count_of(count, {4 + size})",
                "                p = pos + 9",
                "                found = {}",
                "                for _ in range(count):",
                "                    if p + 4 > end:",
                "                        break",
                "                    n = U_I(buf, p)[0]",
                "                    p += 4",
                f"                    if n < 0 or p + n + {size} > end:",
                "                        break",
                "                    try:",
                "                        key = str(buf[p : p + n], 'utf-8')",
                "                    except UnicodeDecodeError:",
                "                        break",
                "                    p += n",
                f"                    found[key] = {unpack}(buf, p)[0]",
                f"                    p += {size}",
                "                else:",
                f"                    values[N{i}] = found",
                "                    pos = p",
                "                if pos != p:  # (the general walk counts them again)",
                "                    self.elements -= count",
                "                    break",
            ]
        else:
            if ttype == _T_STRUCT:
                env[f"RS{i}"] = _lazy_reader(env, f"RS{i}", sub)
                reading = f"RS{i}(self)"
            elif ttype in _T_SEQUENCES:
                reading = f"self._read_list({ttype}, S{i})"
            elif ttype == _T_MAP:
                reading = f"self._read_map(S{i})"
            else:
                reading = f"self._read_value({ttype}, S{i})"
            code += [
                "        if pos + 3 <= end:",
                "            w, f = U_BH(buf, pos)",
                match,
                "                self.pos = pos + 3",
                f"                values[N{i}] = {reading}",
                "                pos = self.pos",
            ]
        code += stop_after
    code += [
        "        if pos < end and buf[pos] == 0:",
        "            self.pos = pos + 1",
        *(line.format(" " * 12) for line in finish),
        "        break",
        "    self.pos = pos",
        "    self._read_fields(BY_ID, values)",
        *(line.format(" " * 4) for line in finish),
    ]
    exec(compile("\n".join(code), _READER_FILE, "exec"), env)
    read: Callable[[BinaryReader], Any] = env["read"]
    return read


# ---------------------------------------------------------------------------
# Writing

_BINARY_WRITERS: dict[Any, Callable[[BinaryWriter, Any], None]] = {}
# A list's header and its few i64 (shapes), by count: packed without making a format each time.
_PACK_LIST_I64S = [struct.Struct(f"!bi{n}q").pack for n in range(9)]


def _binary_writer_of(cls: Any) -> Callable[[BinaryWriter, Any], None]:
    write = _BINARY_WRITERS.get(cls)
    if write is None:
        write = _BINARY_WRITERS[cls] = _binary_writer(cls)
    return write


def _lazy_writer(env: dict[str, Any], key: str, cls: Any) -> Callable[[BinaryWriter, Any], None]:
    """A stand-in for the writer of ``cls`` in ``env[key]``: on its first call it
    puts the real one there (made then, so that recursive structs are no problem)."""

    def first_call(writer: BinaryWriter, obj: Any) -> None:
        write = env[key] = _binary_writer_of(cls)
        write(writer, obj)

    return first_call


def _binary_writer(cls: Any) -> Callable[[BinaryWriter, Any], None]:
    """Make the code that writes a struct of class ``cls`` (BinaryWriter.write_struct).

    Field by field in id order, as Writer.write_struct: a header packed once,
    the common values written in place (strings, binaries, i32, i64, and
    lists of structs, strings or i64, maps of strings to i32 or i64), the
    others (and every binary that goes by reference) by the writer's
    methods. A nested struct of the field's class is written by that class's
    own code, called directly (any other object, by ``write_struct``). Names
    are the code's constants, never its text.
    """
    plan = _plan(cls)
    env: dict[str, Any] = {
        "LocalProtocolError": LocalProtocolError,
        "PACK_I32": _pack_i32,
        "PACK_I64": _pack_i64,
        "PACK_LIST": _S_LIST.pack,
        "PACK_MAP": _S_MAP.pack,
        "PACK_LIST_I64S": _PACK_LIST_I64S,
        "PACK": struct.pack,
        "SMALL": ZERO_COPY_MIN_BYTES,
    }
    # A string or binary ``{value}`` (in place if it is small text or bytes, or
    # a small flat view of bytes: what _write_bytes would do with them).
    write_bytes = [
        "{0}if type({1}) is str:",
        "{0}    {1} = {1}.encode('utf-8')",
        "{0}if type({1}) is bytes and len({1}) < SMALL:",
        "{0}    out += PACK_I32(len({1}))",
        "{0}    out += {1}",
        "{0}elif (",
        "{0}    type({1}) is memoryview and {1}.nbytes < SMALL and {1}.format == 'B'",
        "{0}    and {1}.ndim == 1 and {1}.c_contiguous",
        "{0}):",
        "{0}    out += PACK_I32({1}.nbytes)",
        "{0}    out += {1}",
        "{0}else:",
        "{0}    self._write_bytes({1})",
        "{0}    out = self.out",
    ]
    # Every field's value at once (as getattr(obj, name, None) each, if one is missing).
    names = [name for name, *_ in plan.in_order]
    env["GET"] = operator.attrgetter(*names) if names else None
    code = ["def write(self, obj):"]
    if names:
        targets = ", ".join(f"v{i}" for i in range(len(names))) + ("," if len(names) == 1 else "")
        code += [
            "    try:",
            f"        {targets} = {'(GET(obj),)' if len(names) == 1 else 'GET(obj)'}",
            "    except AttributeError:",
            *(f"        v{i} = getattr(obj, N{i}, None)" for i in range(len(names))),
        ]
    code += ["    out = self.out"]
    for i, (name, _, ttype, sub, required, header) in enumerate(plan.in_order):
        ttype = int(ttype)
        env[f"N{i}"], env[f"H{i}"], env[f"S{i}"] = name, header, sub
        env[f"MISSING{i}"] = f"required field {cls.__name__}.{name} is missing"
        env[f"NO_HEADER{i}"] = f"field {cls.__name__}.{name}: no binary field header"
        code += [f"    v = v{i}"]
        if required:
            code += ["    if v is None:", f"        raise LocalProtocolError(MISSING{i})"]
        code += ["    if v is not None:"]
        if header is None:
            code += [f"        raise LocalProtocolError(NO_HEADER{i})"]
            continue
        code += [f"        out += H{i}"]
        if ttype in _T_BYTES:
            code += [line.format(" " * 8, "v") for line in write_bytes]
        elif ttype == _T_I32:
            code += ["        out += PACK_I32(v)"]
        elif ttype == _T_I64:
            code += ["        out += PACK_I64(v)"]
        elif ttype == _T_STRUCT:
            env[f"C{i}"], env[f"W{i}"] = sub, _lazy_writer(env, f"W{i}", sub)
            code += [
                f"        if type(v) is C{i}:",
                f"            W{i}(self, v)",
                "        else:",
                "            self.write_struct(v)",
                "        out = self.out",
            ]
        elif ttype == _T_LIST and sub[0] in (_T_STRUCT, _T_I64, _T_STRING, _T_BINARY):
            # As BinaryWriter._write_value writes a list, in place.
            etype, esub, ewire = sub
            code += [
                "        items = v if type(v) is list else list(v)",
                "        count = len(items)",
            ]
            if etype == _T_I64:
                code += [
                    "        if not count:",
                    f"            out += PACK_LIST({int(ewire)}, 0)",
                    "        elif count < 9:",
                    f"            out += PACK_LIST_I64S[count]({int(ewire)}, count, *items)",
                    "        else:",
                    f"            out += PACK(f'!bi{{count}}q', {int(ewire)}, count, *items)",
                ]
            elif etype == _T_STRUCT:
                env[f"C{i}"], env[f"W{i}"] = esub, _lazy_writer(env, f"W{i}", esub)
                code += [
                    f"        out += PACK_LIST({int(ewire)}, count)",
                    "        for item in items:",
                    f"            if type(item) is C{i}:",
                    f"                W{i}(self, item)",
                    "            else:",
                    "                self.write_struct(item)",
                    "        out = self.out",
                ]
            else:
                code += [
                    f"        out += PACK_LIST({int(ewire)}, count)",
                    "        for item in items:",
                    *(line.format(" " * 12, "item") for line in write_bytes),
                ]
        elif ttype == _T_MAP and sub[0] == _T_STRING and sub[3] in (_T_I32, _T_I64):
            # As BinaryWriter._write_value writes such a map, in place.
            _, _, kwire, vtype, _, vwire = sub
            pack = "PACK_I32" if vtype == _T_I32 else "PACK_I64"
            code += [
                f"        out += PACK_MAP({int(kwire)}, {int(vwire)}, len(v))",
                "        for key, item in v.items():",
                *(line.format(" " * 12, "key") for line in write_bytes),
                f"            out += {pack}(item)",
            ]
        else:
            code += [f"        self._write_value({ttype}, S{i}, v)", "        out = self.out"]
    code += ["    out.append(0)"]
    exec(compile("\n".join(code), _WRITER_FILE, "exec"), env)
    write: Callable[[BinaryWriter, Any], None] = env["write"]
    return write
