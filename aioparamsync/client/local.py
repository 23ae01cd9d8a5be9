"""A node on this host, reached over TCP: its Unix socket instead, found by asking.

A node listens on a Unix socket beside its TCP port (``--unix-socket PATH``,
or by default an abstract socket of a random name: see
:class:`~aioparamsync.server.transport.ServerConfig`) and says where in
``info().local_socket``. A client that opens a TCP connection to a node on
this host (the connection's two ends at one address, or loopback) asks the
node once, on that connection, before any call goes on it; where the node
names a socket, the node's own port is the one dialed (a proxy between
them, on another port, is not gone around) and the socket answers as that
node, the client connects there instead, from then on: Unix sockets are
faster than TCP on one host, and there the client shares memory with the
node (see :mod:`.shared`), as torch's TensorPipe and Ray's object store do
with workers on their host. Where anything of this fails (no such socket in
this network namespace: a container; a node of another kind; an older
node), the TCP connection is used as before.

An abstract socket's address is ``unix:@NAME``; it is no file, and is seen
only within one network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable
from typing import Any

from ..wire import METHODS
from .connection import _Connection

__all__ = ["PROBE_TIMEOUT", "local_socket_of", "on_this_host", "open_unix"]

log = logging.getLogger(__name__)

# How long the question and the check take at most (seconds): past it, TCP.
PROBE_TIMEOUT = 5.0
# Pauses between tries to connect to a Unix socket whose backlog is full (seconds).
BACKLOG_PAUSES = (0.001, 0.005, 0.01, 0.02, *(0.05,) * 100)


async def open_unix(
    loop: asyncio.AbstractEventLoop, factory: Callable[[], _Connection], path: str
) -> _Connection:
    """Connect to the Unix socket ``path`` (``@NAME``: an abstract one)."""
    # (a Unix socket whose backlog is full refuses at once, EAGAIN, where TCP would send
    # its SYN again: a burst of connections tries again, within the caller's deadline)
    for pause in BACKLOG_PAUSES:
        try:
            return await _connect_unix(loop, factory, path)
        except BlockingIOError:
            await asyncio.sleep(pause)
    return await _connect_unix(loop, factory, path)


async def _connect_unix(
    loop: asyncio.AbstractEventLoop, factory: Callable[[], _Connection], path: str
) -> _Connection:
    if not path.startswith("@"):
        _, conn = await loop.create_unix_connection(factory, path)
        return conn
    return await _open_abstract(loop, factory, path[1:])


async def _open_abstract(
    loop: asyncio.AbstractEventLoop, factory: Callable[[], _Connection], name: str
) -> _Connection:
    # (uvloop's create_unix_connection refuses an abstract name: connected here first)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, "\0" + name)
        _, conn = await loop.create_unix_connection(factory, sock=sock)
    except BaseException:
        sock.close()
        raise
    return conn


def on_this_host(conn: _Connection) -> bool:
    """Whether a TCP connection's far end is on this host: loopback, or the two ends
    at one address."""
    transport = conn.transport
    if transport is None:
        return False
    peer, mine = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not peer or not mine:
        return False
    try:
        address = ipaddress.ip_address(peer[0])
    except ValueError:
        return False
    return address.is_loopback or peer[0] == mine[0]


async def local_socket_of(
    conn: _Connection, port: int, timeout: float, opened: Callable[[str], Any]
) -> tuple[_Connection, str] | None:
    """The node ``conn`` (TCP, to ``port``, on this host) reached at its local socket,
    checked to be that node, and the socket's path; None where it names none or any
    of it fails.

    ``opened(path)`` connects to a Unix socket (awaitable: its connection).
    """
    loop = asyncio.get_running_loop()
    when = loop.time() + timeout
    local = None
    try:
        result = await conn.call(METHODS.info, METHODS.info.args(), when)
        info = result.success
        path = info.local_socket
        if not path or not path.startswith("unix:"):
            return None
        members = info.topology.members if info.topology else []
        if not any(m.node_id == info.node_id and m.port == port for m in members):
            return None  # (its port is not the one dialed: something between, kept)
        async with asyncio.timeout_at(when):
            local = await opened(path[len("unix:") :])
            ping = await local.call(METHODS.ping, METHODS.ping.args(), when)
        if ping.success != info.node_id:
            raise ConnectionError(f"{path} answers as {ping.success!r}, not {info.node_id!r}")
    except asyncio.CancelledError:
        if local is not None:
            local.close()
        raise
    except Exception as exc:  # noqa: BLE001 (any failure: stay on TCP)
        log.debug("staying on TCP to %s: %s: %s", conn.address, type(exc).__name__, exc)
        if local is not None:
            with contextlib.suppress(Exception):
                local.close()
        return None
    return local, path[len("unix:") :]
