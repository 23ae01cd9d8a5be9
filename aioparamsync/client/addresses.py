"""Where a client connects, and how long it waits: addresses and seconds as callers give them.

:func:`parse_address` and :func:`parse_addresses` turn ``"host:port"``,
``"[::1]:port"``, ``(host, port)`` or several of them into ``(host, port)``
pairs, and ``"unix:PATH"`` (a node's ``--unix-socket``) into
``("unix:PATH", 0)``; :func:`check_seconds` checks a deadline or a wait where
it is given.
Both raise ValueError for what they refuse, before anything is sent.
"""

from __future__ import annotations

import ipaddress
import math
import numbers
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "Address",
    "UNIX",
    "check_seconds",
    "is_loopback",
    "unspecified_host",
    "parse_address",
    "parse_addresses",
    "unix_path",
]

Address = str | tuple[str, int]

# A Unix socket's address: "unix:PATH", as the pair ("unix:PATH", 0).
UNIX = "unix:"
# A URL's scheme ("http://", "tcp://", ...): no part of an address a node listens at.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's own: ``localhost``, 127.0.0.0/8, ``::1``."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unspecified_host(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, or empty).

    A node may listen there, but it is no address to give peers: told
    ``0.0.0.0:PORT``, a peer on another machine reaches itself, or nothing.
    """
    host = host.strip()
    if not host:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a name


def unix_path(host: str) -> str | None:
    """The socket path of a Unix socket's address (its host), else None."""
    return host[len(UNIX) :] if host.startswith(UNIX) else None


def parse_addresses(addresses: Address | Iterable[Address]) -> list[tuple[str, int]]:
    """One address, ``"h1:p1,h2:p2"``, or a list of addresses -> ``[(host, port), ...]``.

    Raises:
        ValueError: not addresses, or none.
    """
    if isinstance(addresses, str):
        items: list[Address] = [a for a in addresses.split(",") if a.strip()]
    elif isinstance(addresses, tuple) and len(addresses) == 2 and isinstance(addresses[1], int):
        items = [addresses]
    else:
        items = list(addresses)
    if not items:
        raise ValueError("no address given")
    return [parse_address(a.strip() if isinstance(a, str) else a) for a in items]


def parse_address(address: Address) -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``(host, port)`` -> ``(host, port)``.

    ``"unix:PATH"`` (a Unix socket) -> ``("unix:PATH", 0)``.

    Raises:
        ValueError: not an address (a URL, ``"http://host:9090"``, is not one:
            the message says to drop its scheme).
    """
    if isinstance(address, str) and address.startswith(UNIX):
        if not address[len(UNIX) :] or "\0" in address:
            raise ValueError(f"{address!r}: a Unix socket's address is unix:PATH")
        return address, 0
    if (
        isinstance(address, tuple)
        and len(address) == 2
        and address[1] == 0
        and isinstance(address[0], str)
        and address[0].startswith(UNIX)
    ):
        return parse_address(address[0])
    if isinstance(address, tuple):
        host, port = address
    else:
        if scheme := _SCHEME.match(str(address)):
            # (else "http://host:9090" would read as the host "http://host")
            bare = str(address)[scheme.end() :].split("/", 1)[0]
            raise ValueError(
                f"{address!r}: a node's address is host:port, without a scheme: drop "
                f"{scheme[0]!r} and give {bare!r}"
            )
        host, sep, port_text = str(address).rpartition(":")
        if not sep or not host:
            raise ValueError(f"{address!r} is not host:port")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"{address!r}: port {port_text!r} is not a number") from None
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is out of range")
    return str(host), int(port)


def check_seconds(value: Any, what: str, *, zero: bool = False) -> Any:
    """``value`` if it is a deadline or a wait in seconds: None, or a finite number above 0.

    Every timeout the client takes goes through here, so that ``timeout=0``
    (which would fail every call before it is sent), a negative or NaN
    deadline, infinity (None says "no deadline") or ``True`` is refused where
    it is given, not turned into a puzzling failure later.

    Args:
        value: the number of seconds, or None.
        what: the argument's name, for the error.
        zero: 0 is allowed too (a long poll's ``wait=0``: answer at once).

    Raises:
        ValueError: anything else (bools and non-numbers included).
    """
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
        if math.isfinite(seconds) and (seconds > 0 or (zero and seconds == 0)):
            return value
    bound = "0 or more" if zero else "above 0"
    raise ValueError(f"{what} must be a finite number of seconds {bound}, or None, not {value!r}")
