"""The parser of ``aioparamsync-ctl``: its commands, their arguments, the options of all.

The options (``--json``, ``--timeout``, TLS) are taken before a command's
name or after it; the values of flags are read with :mod:`.options`. The
commands themselves are :mod:`.ctl`'s (``export``'s, :mod:`.export`'s).
"""

from __future__ import annotations

import argparse
from typing import Any

from .._version import __version__
from . import checkpoints, export
from .options import address, positive_seconds

__all__ = ["DEFAULT_TIMEOUT", "PROG", "build_parser"]

PROG = "aioparamsync-ctl"
# Default deadline of connecting, and of each call (seconds).
DEFAULT_TIMEOUT = 5.0


def _address(text: str) -> str:
    host, port = address(text)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _prefix(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave it out to list every name)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # (bytes the shell passed that are not UTF-8)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid UTF-8, so no parameter's name starts with it"
        ) from None
    return text


# The options every command takes, before or after its name, and their defaults.
DEFAULTS: dict[str, Any] = {
    "json": False,
    "timeout": DEFAULT_TIMEOUT,
    "tls": False,
    "tls_ca": None,
    "tls_cert": None,
    "tls_key": None,
}


def _add_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """Add the options every command takes; without ``defaults``, an option left
    out leaves the value alone (so ``--json`` may come before the command or after it)."""

    def default(name: str) -> Any:
        return DEFAULTS[name] if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--json", action="store_true", default=default("json"), help="print one JSON document"
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=default("timeout"),
        metavar="SECONDS",
        help=f"deadline of connecting and of each call (default: {DEFAULT_TIMEOUT:g})",
    )
    tls = parser.add_argument_group("TLS (for a node started with --tls-cert)")
    tls.add_argument("--tls", action="store_true", default=default("tls"), help="connect with TLS")
    tls.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=default("tls_ca"),
        help="CA certificates to verify the node with (implies --tls; default: the system's)",
    )
    tls.add_argument(
        "--tls-cert",
        metavar="PEM",
        default=default("tls_cert"),
        help="a client certificate, for a node that requires one (implies --tls)",
    )
    tls.add_argument(
        "--tls-key",
        metavar="PEM",
        default=default("tls_key"),
        help="its private key (if not in --tls-cert)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect a running aioparamsync node and its cluster. No command "
        "changes it, but drain, which makes it leave its cluster, shutdown, which stops "
        "the cluster, and restore, which writes a checkpoint into it.",
        epilog="Exit codes: 0 done; 1 the node could not be reached, did not answer in time, "
        "refused, or is no node, or (export, checkpoint, restore) the files could not be "
        "written or read; 2 bad arguments; "
        "3 (get, export) some name is no parameter on the node.",
    )
    _add_options(parser, defaults=True)
    parser.set_defaults(route=False)  # (export's reads go to the nodes holding what they read)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary, prog=f"{PROG} {name}")
        _add_options(sub, defaults=False)
        sub.add_argument("address", type=_address, metavar="ADDRESS", help="the node's host:port")
        return sub

    command("stats", "the node's id, version, parameters, timestamp, uptime and counters")
    command("peers", "the node's peer links: state, outbox, updates sent, failures, lag")
    command("waiting", "the long polls and barriers the node holds, and whom each waits for")
    get = command("get", "parameters: version, origin, dtype, shape and a preview of the value")
    get.add_argument("names", nargs="+", metavar="NAME", help="a parameter's name")
    listing = command("list", "the parameters' names, dtypes, shapes, versions and sizes")
    listing.add_argument(
        "prefix",
        nargs="?",
        type=_prefix,
        metavar="PREFIX",
        help="only the names that start with it (plain text, not a pattern)",
    )
    command("ping", "the node's id and the round trip of one call")
    export.add_parser(command)
    checkpoints.add_parsers(command)
    command(
        "topology",
        "the cluster as the node sees it: epoch, replication factor, each member's state, "
        "and what each member up holds, is moving and has under-replicated",
    )
    drain = command(
        "drain",
        "make the node leave its cluster: it hands every key to its next holders, then exits",
    )
    drain.add_argument(
        "--wait",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="the longest the node hands keys off before it leaves anyway (default: its "
        "--drain-timeout); the command's --timeout should be longer",
    )
    shutdown = command(
        "shutdown",
        "stop every node of the node's cluster (none hands anything off), so a job ends",
    )
    shutdown.add_argument(
        "--snapshot",
        action="store_true",
        help="each node with a data directory takes no more writes and writes its final "
        "snapshot before it answers (else it writes it as it stops)",
    )
    shutdown.add_argument(
        "--only-this-node",
        action="store_true",
        help="stop this node alone (its peers see it down, as a node to come back)",
    )
    return parser
