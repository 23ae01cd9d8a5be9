"""``aioparamsync-node --processes N``: N node processes on one host, one cluster.

One node is one process, and one process runs Python on one core at a time.
With sharding, several nodes on one host each hold their share of the keys
and each answers its own calls, so a host's cores all work. This launcher
starts the N processes, each a member of the cluster, and supervises them.

Theory of operation. The processes are ``aioparamsync-node`` with the same
flags (those of the environment included) but these, for process ``i``:

* ``--port``: PORT + i (with ``--port 0``: each picks a free one);
* ``--node-id``: ID-i, if an id is given (else each is its advertised address);
* ``--advertise``: HOST:(PORT + i), if given;
* ``--data-dir``: DIR/shard-i; ``--metrics-port``: M + i (0: free ones);
* ``--unix-socket``: PATH for process 0, PATH.i for the others;
* ``--peers``: process 0 joins the given peers (if any); every other process
  joins process 0, once it listens.

Clients may connect to any of them (process 0's port is the one to give out):
they learn the topology and then call each key's primary directly.

Supervision: each process's output goes where the launcher's does, its
listening line included. SIGINT or SIGTERM is passed to every process, which
then drains (hands its keys off) and stops; the launcher exits once all have,
non-zero if any failed. A process that exits by itself after it listened,
other than by a planned leave (``aioparamsync-ctl drain``: exit status 0), is
started again after ``RESTART_DELAY`` seconds with the same flags (its data
directory, if any, brings its state back). One that exits before it listens
(a bad flag, a port taken) stops them all: the launcher exits with its status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from ..values import parallel

__all__ = ["RESTART_DELAY", "child_argv", "supervise"]

# Seconds before a process that died is started again.
RESTART_DELAY = 1.0
# The longest wait for a process's listening line (seconds).
START_TIMEOUT = 60.0
_LISTENING = b" listening on "


def _text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def child_argv(
    argv: Sequence[str], args: argparse.Namespace, i: int, first: str | None
) -> list[str]:
    """The flags of process ``i``: ``argv`` without ``--processes``, then its own.

    ``args`` are the parsed flags; ``first`` is process 0's ``host:port`` (for
    the others to join).
    """
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            out.append(arg)
    out += ["--port", str(args.port + i if args.port else 0)]
    if args.node_id:
        out += ["--node-id", f"{args.node_id}-{i}"]
    if args.advertise is not None:
        host, port = args.advertise
        out += ["--advertise", _text(host, port + i)]
    if args.data_dir is not None:
        out += ["--data-dir", os.path.join(args.data_dir, f"shard-{i}")]
    if args.metrics_port is not None:
        out += ["--metrics-port", str(args.metrics_port + i if args.metrics_port else 0)]
    if args.unix_socket is not None and i:
        out += ["--unix-socket", f"{args.unix_socket}.{i}"]
    if i and first is not None:
        out += ["--peers", ",".join([first, *(_text(h, p) for h, p in args.peers)])]
    if args.fold_threads is None:  # (the host's cores shared out, as torchrun's OMP threads)
        cores = max(1, (os.cpu_count() or 1) // max(1, args.processes))
        out += ["--fold-threads", str(min(parallel.DEFAULT_MOST, cores))]
    return out


class _Process:
    """One node process of the launcher, and its output pumped to the launcher's."""

    def __init__(self, i: int, argv: list[str], env: Mapping[str, str]) -> None:
        self.i = i
        self.argv = argv
        self.env = dict(env)
        self.proc: asyncio.subprocess.Process | None = None
        self.address: str | None = None  # host:port, from its listening line
        self.listening = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.listening.clear()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aioparamsync",
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=self.env,
        )
        self._pump = asyncio.ensure_future(self._copy_output())

    async def _copy_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            if not self.listening.is_set() and _LISTENING in line:
                where = line.split(_LISTENING, 1)[1].split()[0].decode()
                self.address = where
                self.listening.set()
            sys.stdout.buffer.write(line)
            sys.stdout.flush()

    async def wait(self) -> int:
        assert self.proc is not None
        rc = await self.proc.wait()
        if self._pump is not None:
            await self._pump
        return rc

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


async def _started(process: _Process) -> bool:
    """Start ``process``; answer whether it listens (False: it exited first)."""
    await process.start()
    listening = asyncio.ensure_future(process.listening.wait())
    exited = asyncio.ensure_future(process.wait())
    try:
        await asyncio.wait(
            [listening, exited], timeout=START_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        listening.cancel()
    if process.listening.is_set():
        exited.cancel()
        return True
    if not exited.done():
        process.signal(signal.SIGKILL)  # (no listening line within START_TIMEOUT)
    await asyncio.wait([exited])
    return False


async def supervise(
    n: int,
    argv: Sequence[str],
    args: argparse.Namespace,
    env: Mapping[str, str],
    flag_names: Sequence[str],
) -> int:
    """Run ``n`` node processes (see the module's docstring) until SIGINT or SIGTERM.

    ``argv`` are the launcher's flags, those of the environment included;
    ``flag_names`` the environment variables of the flags, which the processes
    do not get (their flags say it all).
    """
    child_env = {k: v for k, v in env.items() if k not in flag_names}
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    processes: list[_Process] = []
    first: str | None = None
    for i in range(n):
        process = _Process(i, child_argv(argv, args, i, first), child_env)
        processes.append(process)
        if not await _started(process):
            for other in processes[:-1]:
                other.signal(signal.SIGTERM)
            await asyncio.gather(*(p.wait() for p in processes[:-1]))
            rc = process.proc.returncode if process.proc is not None else 1
            print(
                f"aioparamsync-node: process {i} of {n} exited with {rc} before it listened",
                file=sys.stderr,
            )
            return rc or 1
        if i == 0:
            # (where the others reach it: its advertised address, if one is given)
            first = _text(*args.advertise) if args.advertise is not None else process.address
        if stopping.is_set():
            break

    async def keep(process: _Process) -> int:
        while True:
            rc = await process.wait()
            if stopping.is_set() or rc == 0:
                return rc  # (stopped, or left the cluster as asked: not started again)
            print(
                f"aioparamsync-node: process {process.i} exited with {rc}; starting it again "
                f"in {RESTART_DELAY} s",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), RESTART_DELAY)
            if stopping.is_set():
                return rc
            if not await _started(process):
                return (process.proc.returncode if process.proc is not None else None) or 1

    kept = [asyncio.ensure_future(keep(p)) for p in processes]
    stop = asyncio.ensure_future(stopping.wait())
    pending: set[asyncio.Future] = {stop, *kept}
    while not stopping.is_set() and not all(k.done() for k in kept):
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    for process in processes:
        process.signal(signal.SIGTERM)
    codes = await asyncio.gather(*kept)
    stop.cancel()
    return next((rc for rc in codes if rc), 0)
