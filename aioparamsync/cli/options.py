"""The values both command lines read from their flags: argparse ``type=`` functions.

Each takes the text as given and answers the value, or raises
:class:`argparse.ArgumentTypeError` with a message that quotes the text
(argparse prefixes it with the flag's name, and exits 2). Sizes, addresses
and seconds are read here once, so that ``aioparamsync-node`` and
``aioparamsync-ctl`` read them alike; a rule only one command has (a frame
size, a name prefix) stays with that command. So does which TLS flags need
which: both catch :data:`TLS_ERRORS` from making the context.
"""

from __future__ import annotations

import argparse
import math

from ..client.addresses import check_seconds, parse_address, parse_addresses
from ..client.environment import SIZE_UNITS, parse_size

__all__ = [
    "byte_size",
    "human_size",
    "port_number",
    "positive_int",
    "process_count",
    "seconds",
    "positive_seconds",
    "address",
    "addresses",
    "TLS_ERRORS",
]

# What making a TLS context from the TLS flags may raise, to report as "TLS: ...": an
# OSError for a PEM file missing, unreadable or not what it should be (ssl.SSLError is an
# OSError), a ValueError for values that do not go together.
TLS_ERRORS = (OSError, ValueError)


def byte_size(text: str) -> int:
    """``"64MiB"``, ``"512k"``, ``"1048576"`` -> bytes (k, m and g count in powers of 1024,
    written alone or with "iB" or "B": as ``AIOPARAMSYNC_SHARED_MEMORY`` is read)."""
    size = parse_size(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 268435456, 256MiB)")
    return size


def human_size(value: int) -> str:
    """Bytes as :func:`byte_size` reads them: ``268435456`` -> ``"256MiB"``.

    The largest unit that divides ``value`` exactly, or bytes.
    """
    for unit in ("g", "m", "k"):
        factor = SIZE_UNITS[unit]
        if value and value % factor == 0:
            return f"{value // factor}{unit.upper()}iB"
    return str(value)


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def process_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes") from None
    if not 1 <= n <= 1024:
        raise argparse.ArgumentTypeError(f"{n} processes: from 1 to 1024")
    return n


def _number_of_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def seconds(text: str) -> float | None:
    """A wait or a deadline that 0 turns off: seconds >= 0, 0 -> None."""
    value = _number_of_seconds(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be a finite number >= 0")
    return value or None


def positive_seconds(text: str) -> float:
    """Seconds above 0 (and finite): as the client takes a timeout."""
    value = _number_of_seconds(text)
    try:
        check_seconds(value, text)  # (the client's own rule)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be a finite number of seconds > 0"
        ) from None
    return value


def address(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[::1]:port"`` -> ``(host, port)``."""
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def addresses(text: str) -> list[tuple[str, int]]:
    """``"h1:p1,h2:p2"`` -> ``[(host, port), ...]``, at least one."""
    try:
        return parse_addresses(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
