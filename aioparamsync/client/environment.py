"""A client configured by its environment, as the nodes are: :meth:`ParameterClient.from_env`.

A worker launched by an engine (a Kubernetes Job, torchrun, Ray) is told where
the cluster is the way the engine tells it everything else: by environment
variables. They are the node's own (``aioparamsync-node`` reads every flag as
``AIOPARAMSYNC_<FLAG>``), so one set of variables serves nodes and workers:

* ``AIOPARAMSYNC_ADDRESSES``: the nodes, ``HOST:PORT,HOST:PORT``; any one
  live node will do (the client learns the others from it). A DNS name is
  fine: the name of a Kubernetes headless Service reaches its pods.
* else ``AIOPARAMSYNC_PEERS_DNS``: the ``NAME:PORT`` the nodes find each
  other by (``--peers-dns``).
* ``AIOPARAMSYNC_TLS_CA``, ``AIOPARAMSYNC_TLS_CERT``, ``AIOPARAMSYNC_TLS_KEY``:
  the CA to verify nodes with, and a certificate (and its key) to present
  to nodes that verify their clients. Any of them, or ``AIOPARAMSYNC_TLS=1``
  (with the system's CAs), turns TLS on.
* ``AIOPARAMSYNC_SHARED_MEMORY``: the most memory a client of a node on its
  host (``unix:PATH``) shares with it, a size as the nodes' flags take them
  (``1GiB``, ``256m``, ``0``: none); see :mod:`.shared`.

What is wrong is refused with a ValueError naming the variable, before
anything connects.
"""

from __future__ import annotations

import os
import re
import ssl as ssl_module
from collections.abc import Mapping
from typing import Any

from ..tls import client_context
from .addresses import parse_addresses

__all__ = [
    "ENV_PREFIX",
    "SIZE_UNITS",
    "SWITCH_FALSE",
    "SWITCH_TRUE",
    "client_options",
    "parse_size",
    "switch",
]

ENV_PREFIX = "AIOPARAMSYNC_"
#: how a switch's variable says yes, and no (case aside)
SWITCH_TRUE = ("1", "true", "yes", "on")
SWITCH_FALSE = ("0", "false", "no", "off", "")

ADDRESSES = ENV_PREFIX + "ADDRESSES"
PEERS_DNS = ENV_PREFIX + "PEERS_DNS"
TLS = ENV_PREFIX + "TLS"
TLS_CA = ENV_PREFIX + "TLS_CA"
TLS_CERT = ENV_PREFIX + "TLS_CERT"
TLS_KEY = ENV_PREFIX + "TLS_KEY"
SHARED_MEMORY = ENV_PREFIX + "SHARED_MEMORY"

# A size: a number and an optional unit; k, m and g count in powers of 1024,
# written alone or with "iB" or "B" (64k = 64KiB = 64KB = 65536).
_SIZE = re.compile(r"(\d+)\s*([kmg]?)(?:i?b)?", re.IGNORECASE)
SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text: str) -> int | None:
    """``"64MiB"``, ``"512k"``, ``"1048576"`` -> bytes; None: not a size."""
    match = _SIZE.fullmatch(text.strip())
    return None if match is None else int(match[1]) * SIZE_UNITS[match[2].lower()]


def switch(name: str, value: str) -> bool:
    """A switch's value: 1/true/yes/on or 0/false/no/off (or empty).

    Raises:
        ValueError: anything else, naming the variable.
    """
    word = value.strip().lower()
    if word not in SWITCH_TRUE + SWITCH_FALSE:
        raise ValueError(f"{name}={value!r}: a switch is one of 1/true/yes/on or 0/false/no/off")
    return word in SWITCH_TRUE


def client_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``address``, ``ssl`` and ``shared_memory`` of a :class:`ParameterClient`, from
    ``environ``
    (default: ``os.environ``); see the module.

    Raises:
        ValueError: no addresses, or a variable that is not what it should be.
    """
    environ = os.environ if environ is None else environ
    name = ADDRESSES if environ.get(ADDRESSES, "").strip() else PEERS_DNS
    text = environ.get(name, "").strip()
    if not text:
        raise ValueError(
            f"no nodes named: set {ADDRESSES} to their HOST:PORT,... (or {PEERS_DNS} "
            "to a NAME:PORT that resolves to them)"
        )
    try:
        addresses = parse_addresses(text)
    except ValueError as exc:
        raise ValueError(f"{name}={text!r}: {exc}") from None
    files = {var: environ.get(var, "").strip() or None for var in (TLS_CA, TLS_CERT, TLS_KEY)}
    wanted = switch(TLS, environ[TLS]) if TLS in environ else False
    if files[TLS_KEY] and not files[TLS_CERT]:
        raise ValueError(f"{TLS_KEY} needs {TLS_CERT} (the certificate it is the key of)")
    context = None
    if wanted or any(files.values()):
        for var, path in files.items():
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{var}={path!r}: no such file")
        try:
            context = client_context(files[TLS_CA], files[TLS_CERT], files[TLS_KEY])
        except (ssl_module.SSLError, OSError) as exc:
            shown = ", ".join(f"{var}={path!r}" for var, path in files.items() if path)
            raise ValueError(f"TLS from the environment ({shown}): {exc}") from None
    options: dict[str, Any] = {"address": addresses, "ssl": context}
    if SHARED_MEMORY in environ:
        size = parse_size(text := environ[SHARED_MEMORY])
        if size is None:
            raise ValueError(f"{SHARED_MEMORY}={text!r} is not a size (e.g. 1GiB, 256m, 0)")
        options["shared_memory"] = size
    return options
