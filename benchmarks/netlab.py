#!/usr/bin/env python3
"""A network test bed on one machine: hosts as Linux network namespaces, links shaped by tc.

On loopback every process of a cluster shares one network stack and no link is ever a
bottleneck, so a benchmark cannot tell whether the cluster scales. Here each node and
each worker is a *host* of its own: a network namespace with one interface, ``eth0``,
joined to the others by a Linux bridge, each link shaped to a rate of its own::

    with NetLab() as lab:
        a = lab.host("n0", mbit=300)          # 10.77.0.1, 300 Mbit/s each way
        b = lab.host("w0", mbit=300)          # 10.77.0.2
        node = a.popen(["python", "-m", "aioparamsync", "--host", a.ip, "--port", "7000"])
        b.run(["python", "worker.py", f"{a.ip}:7000"])
    # every process the lab started is stopped, every namespace it made deleted

How it is built. Nothing is made in the machine's own (root) network namespace:

* the **switch** is a namespace of its own (``TAG-sw``) holding the bridge ``br0``;
* a **host** is a namespace ``TAG-NAME`` with loopback up and ``eth0``, one end of a
  veth pair whose other end (``pI``, its port) is created inside the switch namespace
  and enslaved to ``br0`` (``ip -n TAG-sw link add pI type veth peer name eth0 netns
  TAG-NAME``: both ends are born where they live, so their names need only be unique
  there, and two labs at once never collide);
* host ``I`` (from 1) has address ``10.77.0.I/24`` and no route beyond that subnet: the
  lab is an isolated layer-2 island, a process in it can reach the lab's hosts and
  nothing else (any other address is unreachable), and the machine's own network is
  never touched. Every lab uses the same subnet: each is an island of its own.

``TAG`` is ``aps{pid}x{counter}``: the PID of the process that made the lab, and a
counter within it. ``python benchmarks/netlab.py --cleanup`` deletes what labs of
processes no longer alive left behind (a driver killed by SIGKILL), and only those.

Link shaping (``tc``; this machine has htb and tbf, no netem): a host's upload is an
htb class on its ``eth0`` egress, its download one on its switch port's egress (what
the bridge sends to it). ``rate = ceil = mbit``, ``burst = cburst =`` 1 ms of the rate
(at least 15 kB, so that 10 Gbit/s works), quantum the burst (1514..200000 bytes), and a
byte FIFO of 20 ms of the rate (at least 256 KiB) under it: a bounded queue, as a
switch port has. ``mbit=0`` or None: that host's link is not shaped. ``measure()``
checks a shaped link with a TCP transfer between two hosts (``--demo`` does it).

Processes: ``host.popen(argv, **kw)`` runs ``ip netns exec NS argv...`` (``ip`` switches
namespace and executes the command in place: the PID is the command's) in a session of
its own (``start_new_session=True``, so a Ctrl-C at the terminal does not reach it),
and the lab keeps it. ``host.run(argv)`` runs a short command to its end.

Cleanup, on leaving the ``with`` block, on an exception, on Ctrl-C (KeyboardInterrupt)
and on SIGTERM (while a lab is open in the main thread, SIGTERM raises ``SystemExit(143)``,
so the same path runs; the previous handler comes back when it closes), and at
interpreter exit (``atexit``) for a lab never closed:

1. SIGTERM to the process group of every process the lab started (only while that
   process is not yet reaped, so its PID, the group's id, is still its own);
2. up to 5 s for them and anything else inside the lab's namespaces to exit, then
   SIGKILL to whatever is left inside them (each found by its network namespace and
   signalled through a pidfd: no PID is ever signalled that is not in the lab);
3. every namespace of the lab deleted (a namespace's veths go with it).

Needs root (namespaces, veths, qdiscs), iproute2's ``ip`` and ``tc``, and the kernel's
veth, bridge and htb: :class:`NetLabUnavailable` says which is missing.

Command line::

    python benchmarks/netlab.py --demo [--mbit 100]   # 2 hosts, the shaped rate measured
    python benchmarks/netlab.py --cleanup [--tag TAG] # leftovers of dead labs (or of one)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()
SUBNET = "10.77.0"  # host I is SUBNET.I/24
PREFIX = "aps"
#: a namespace of a lab: aps{pid}x{counter}-{name}
NS_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-([a-z0-9]+)$")
HOST_NAME = re.compile(r"^[a-z0-9]{1,20}$")
SWITCH = "sw"  # the switch namespace's suffix (no host may be called so)
BRIDGE = "br0"
MAX_HOSTS = 250
STOP_TIMEOUT = 5.0  # SIGTERM, then this long, then SIGKILL
IP_TIMEOUT = 30.0  # one ip/tc command
MEASURE_PORT = 5201

_counter = itertools.count(1)
#: a command line's word: a string or a path
Arg = str | os.PathLike[str]


class NetLabUnavailable(RuntimeError):
    """The machine cannot make a lab: the message says what is needed."""


def requirements() -> str | None:
    """Why no lab can be made here (root, ``ip``, ``tc``), or None when those are present."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return (
            "needs root (network namespaces, veth pairs and tc qdiscs need CAP_NET_ADMIN "
            "and CAP_SYS_ADMIN): run as root (CI does)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2's {' and '.join(missing)} on PATH (apt-get install iproute2)"
    return None


def new_tag() -> str:
    """A tag no namespace on the machine carries yet: ``aps{pid}x{counter}``."""
    existing = namespaces()
    while True:
        tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        if not any(ns.startswith(tag + "-") for ns in existing):
            return tag


def probe() -> str | None:
    """Whether a lab can be made here: None, or why not (root, tools, ``ip netns add``).

    Creates and deletes a throwaway namespace of a fresh tag.
    """
    reason = requirements()
    if reason:
        return reason
    ns = f"{new_tag()}-probe"
    done = _ip(["netns", "add", ns], check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _ip(["netns", "del", ns], check=False)
    return None


def namespaces() -> list[str]:
    """The names of the machine's named network namespaces (``ip netns list``)."""
    if shutil.which("ip") is None:
        return []
    out = _ip(["netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ip(args: Sequence[str], *, check: bool = True, stdin: str | None = None) -> Any:
    return _tool("ip", args, check=check, stdin=stdin)


def _tool(tool: str, args: Sequence[str], *, check: bool = True, stdin: str | None = None) -> Any:
    done = subprocess.run(
        [tool, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=IP_TIMEOUT,
        check=False,
    )
    if check and done.returncode != 0:
        shown = " ".join(args) if stdin is None else f"{' '.join(args)} <<< {stdin.strip()!r}"
        raise subprocess.CalledProcessError(
            done.returncode, f"{tool} {shown}", done.stdout, done.stderr
        )
    return done


def shaping(dev: str, mbit: float) -> list[str]:
    """The ``tc`` commands (a batch, one per line) that shape ``dev``'s egress to ``mbit``."""
    rate = mbit * 1e6 / 8  # bytes/s
    burst = max(15_000, int(rate * 1e-3))  # 1 ms of the rate
    quantum = min(max(burst, 1514), 200_000)
    limit = max(256 * 1024, int(rate * 0.02))  # a 20 ms queue
    kbit = max(1, round(mbit * 1000))
    return [
        f"qdisc add dev {dev} root handle 1: htb default 1",
        f"class add dev {dev} parent 1: classid 1:1 htb rate {kbit}kbit ceil {kbit}kbit "
        f"burst {burst} cburst {burst} quantum {quantum}",
        f"qdisc add dev {dev} parent 1:1 handle 10: bfifo limit {limit}",
    ]


# ---------------------------------------------------------------------------
# Processes inside namespaces


def _ns_identity(ns: str) -> tuple[int, int] | None:
    """(device, inode) of namespace ``ns`` (its nsfs file), or None when it is gone."""
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in(identities: Sequence[tuple[int, int]]) -> list[int]:
    """The processes whose network namespace is one of ``identities`` (as ``ip netns pids``)."""
    wanted = set(identities)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted:
            found.append(int(entry))
    return found


def signal_in(identities: Sequence[tuple[int, int]], sig: int) -> int:
    """Send ``sig`` to every process inside the namespaces ``identities``; answers how many.

    Each through a pidfd opened before its namespace is checked again, so a PID
    that was reused in between is never signalled.
    """
    wanted = set(identities)
    sent = 0
    for pid in pids_in(identities):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
            if (st.st_dev, st.st_ino) in wanted:
                signal.pidfd_send_signal(fd, sig)
                sent += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return sent


def _delete_namespaces(names: Sequence[str]) -> None:
    if names:
        _ip(
            ["-force", "-batch", "-"], check=False, stdin="".join(f"netns del {n}\n" for n in names)
        )


def _empty_namespaces(names: Sequence[str], timeout: float) -> None:
    """SIGKILL whatever still runs in ``names`` unless it exits within ``timeout`` s."""
    ids = [i for i in (_ns_identity(n) for n in names) if i is not None]
    deadline = time.monotonic() + timeout
    while pids_in(ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(50):
        if not signal_in(ids, signal.SIGKILL):
            return
        time.sleep(0.02)


# ---------------------------------------------------------------------------
# The lab


@dataclass
class Host:
    """One host of a lab: namespace ``ns``, address ``ip`` (on its ``eth0``), link ``mbit``."""

    lab: NetLab
    name: str
    index: int
    ns: str
    ip: str
    mbit: float | None
    port: str  # its port on the switch (the veth end in the switch namespace)

    def argv(self, argv: Sequence[Arg]) -> list[str]:
        """``argv`` as run inside this host."""
        return ["ip", "netns", "exec", self.ns, *(os.fspath(a) for a in argv)]

    def popen(self, argv: Sequence[Arg], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host, in a session of its own; the lab stops it."""
        return self.lab._popen(self, argv, **kw)

    def run(
        self, argv: Sequence[Arg], *, timeout: float = 60.0, check: bool = True, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command inside this host to its end (output captured, as text)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, check=check, **kw)


class NetLab:
    """Hosts as network namespaces on one bridge, in a switch namespace of their own.

    A context manager: entering makes the switch, :meth:`host` adds hosts,
    leaving stops every process started with :meth:`Host.popen` and deletes every
    namespace the lab made (see the module's docstring for how, and on which
    signals).

    Raises:
        NetLabUnavailable: not root, no ``ip``/``tc``, or the kernel refuses
            namespaces, veths, bridges or htb (the message says what is needed).
    """

    def __init__(self) -> None:
        self.tag = ""
        self.switch = ""
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []  # made so far, in order
        self._processes: list[subprocess.Popen[Any]] = []
        self._lock = threading.Lock()
        self._open = False
        self._previous: dict[int, Any] = {}

    # -- life cycle ----------------------------------------------------------------

    def __enter__(self) -> NetLab:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        reason = requirements()
        if reason:
            raise NetLabUnavailable(reason)
        self.tag = new_tag()
        self.switch = f"{self.tag}-{SWITCH}"
        self._open = True
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _sigterm)
        try:
            self._add_namespace(self.switch)
            self._batch(
                "ip",
                self.switch,
                [f"link add {BRIDGE} type bridge", f"link set {BRIDGE} up", "link set lo up"],
                "a bridge (the kernel's bridge module)",
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process of the lab, delete its namespaces (idempotent)."""
        if not self._open:
            return
        self._open = False
        atexit.unregister(self.close)
        # Signals that come while cleaning up wait until it is done (then act as before).
        held: list[int] = []
        main = threading.current_thread() is threading.main_thread()
        if main:
            current = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            for s in current:
                signal.signal(s, lambda sig, _frame: held.append(sig))
        try:
            self._stop_processes()
            _delete_namespaces(list(reversed(self._namespaces)))
            self._namespaces.clear()
        finally:
            if main:
                for s, handler in current.items():
                    signal.signal(s, _handler(handler))
                if signal.SIGTERM in self._previous:
                    signal.signal(signal.SIGTERM, _handler(self._previous.pop(signal.SIGTERM)))
                for sig in held:
                    signal.raise_signal(sig)

    def _stop_processes(self) -> None:
        with self._lock:
            processes = list(self._processes)
            self._processes.clear()
        for p in processes:
            # Unreaped, its PID (its group's id) is still its own, even if it exited.
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for p in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        # Anything else still inside the lab (a child that left its group): what the
        # lab's processes started, and nothing else can be there.
        _empty_namespaces(self._namespaces, max(0.0, deadline - time.monotonic()))
        for p in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(STOP_TIMEOUT)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()

    # -- hosts -----------------------------------------------------------------------

    def host(self, name: str, mbit: float | None = None) -> Host:
        """A new host ``name`` (lower-case letters and digits) with a link of ``mbit`` Mbit/s
        each way (0 or None: not shaped), at the next address of the subnet."""
        if not self._open:
            raise RuntimeError("the lab is not open")
        if not HOST_NAME.match(name) or name == SWITCH or name in self.hosts:
            raise ValueError(f"a host name is new, [a-z0-9]{{1,20}} and not {SWITCH!r}: {name!r}")
        index = len(self.hosts) + 1
        if index > MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} hosts in a lab")
        ns = f"{self.tag}-{name}"
        port = f"p{index}"
        host = Host(self, name, index, ns, f"{SUBNET}.{index}", mbit or None, port)
        self._add_namespace(ns)
        self._batch(
            "ip",
            self.switch,
            [
                f"link add {port} type veth peer name eth0 netns {ns}",
                f"link set {port} master {BRIDGE}",
                f"link set {port} up",
            ],
            "veth pairs (the kernel's veth module)",
        )
        self._batch(
            "ip",
            ns,
            ["link set lo up", f"addr add {host.ip}/24 dev eth0", "link set eth0 up"],
            "addresses",
        )
        if host.mbit:
            need = "htb (the kernel's sch_htb module) and bfifo"
            self._batch("tc", ns, shaping("eth0", host.mbit), need)
            self._batch("tc", self.switch, shaping(port, host.mbit), need)
        self.hosts[name] = host
        return host

    def _add_namespace(self, ns: str) -> None:
        done = _ip(["netns", "add", ns], check=False)
        if done.returncode != 0:
            raise NetLabUnavailable(f"`ip netns add {ns}` failed: {done.stderr.strip()}")
        self._namespaces.append(ns)

    def _batch(self, tool: str, ns: str, commands: Sequence[str], need: str) -> None:
        done = _tool(tool, ["-n", ns, "-batch", "-"], check=False, stdin="\n".join(commands) + "\n")
        if done.returncode != 0:
            raise NetLabUnavailable(
                f"`{tool} -n {ns}` failed ({done.stderr.strip()}): the lab needs {need}"
            )

    def _popen(self, host: Host, argv: Sequence[Arg], **kw: Any) -> subprocess.Popen[Any]:
        if not self._open:
            raise RuntimeError("the lab is not open")
        kw["start_new_session"] = True
        proc = subprocess.Popen(host.argv(argv), **kw)
        with self._lock:
            self._processes.append(proc)
        return proc

    def namespaces(self) -> list[str]:
        """The namespaces this lab made and has not deleted yet."""
        return list(self._namespaces)


def _sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _handler(previous: Any) -> Any:
    """A handler ``signal.getsignal`` answered, as ``signal.signal`` takes it (None: one
    not set from Python, taken as the default)."""
    return signal.SIG_DFL if previous is None else previous


# ---------------------------------------------------------------------------
# Measuring a link: a TCP sender and receiver (this script, run inside hosts)


@dataclass
class Transfer:
    """A TCP transfer as the receiver saw it: bytes, and the time from first to last byte."""

    nbytes: int
    seconds: float

    @property
    def mbit(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6 if self.seconds > 0 else 0.0


def measure(
    src: Host,
    dst: Host,
    *,
    seconds: float | None = 2.0,
    nbytes: int | None = None,
    port: int = MEASURE_PORT,
    timeout: float = 60.0,
) -> Transfer:
    """Send from ``src`` to ``dst`` over TCP for ``seconds`` (or exactly ``nbytes``).

    The receiver, in ``dst``, counts from the first byte to the last (the first
    read's bytes excluded: they arrived at the clock's start).
    """
    python = sys.executable
    receiver = dst.popen(
        [python, THIS, "--recv", dst.ip, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        first = read_line(receiver, time.monotonic() + timeout)
        if first.strip() != "listening":
            raise RuntimeError(f"the receiver said {first!r}")
        how = ["--bytes", str(nbytes)] if nbytes is not None else ["--seconds", str(seconds)]
        src.run([python, THIS, "--send", dst.ip, str(port), *how], timeout=timeout)
        result = json.loads(read_line(receiver, time.monotonic() + timeout))
        receiver.wait(timeout)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
        for f in (receiver.stdout, receiver.stderr):
            if f is not None:
                f.close()
    return Transfer(result["bytes"], result["seconds"])


def read_line(proc: subprocess.Popen[Any], deadline: float) -> str:
    """One line of ``proc``'s stdout (bytes pipe) by ``deadline``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no line from the process in time")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1)
            if not chunk:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"the process ended: {err[-2000:]}")
            data += chunk
    return data.decode()


def _receive(ip: str, port: int) -> int:
    with socket.create_server((ip, port)) as server:
        print("listening", flush=True)
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(1 << 20)
            total = first = 0
            t_first = t_last = 0.0
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                now = time.perf_counter()
                if not total:
                    t_first, first = now, n
                total += n
                t_last = now
    print(json.dumps({"bytes": total - first, "seconds": t_last - t_first}), flush=True)
    return 0


def _send(ip: str, port: int, seconds: float | None, nbytes: int | None) -> int:
    chunk = memoryview(bytes(256 * 1024))
    with socket.create_connection((ip, port), timeout=30) as conn:
        if nbytes is not None:
            left = nbytes
            while left:
                left -= conn.send(chunk[: min(left, len(chunk))])
        else:
            assert seconds is not None
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # until the receiver closes: every byte has arrived
    return 0


# ---------------------------------------------------------------------------
# Leftovers of labs whose process is gone


def leftovers() -> dict[str, list[str]]:
    """Namespaces of labs (by tag) whose process no longer runs."""
    dead: dict[str, list[str]] = {}
    for ns in namespaces():
        match = NS_NAME.match(ns)
        if not match:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.setdefault(f"{PREFIX}{pid}x{match.group(2)}", []).append(ns)
        except PermissionError:
            pass  # alive (someone else's PID): not a leftover
    return dead


def cleanup(tags: Sequence[str] | None = None) -> list[str]:
    """Delete the namespaces of dead labs (of ``tags`` only, if given), and stop what still
    runs in them; answer the namespaces deleted."""
    removed = []
    for tag, names in leftovers().items():
        if tags is not None and tag not in tags:
            continue
        _empty_namespaces(names, 0.0)
        _delete_namespaces(names)
        removed += names
    return removed


def demo(mbit: float, seconds: float) -> int:
    with NetLab() as lab:
        a, b = lab.host("a", mbit=mbit), lab.host("b", mbit=mbit)
        print(f"lab {lab.tag}: {a.name} {a.ip} and {b.name} {b.ip}, links {mbit} Mbit/s each way")
        for src, dst in ((a, b), (b, a)):
            t = measure(src, dst, seconds=seconds)
            print(
                f"{src.name} -> {dst.name}: {t.nbytes / 1e6:.1f} MB in {t.seconds:.2f} s = "
                f"{t.mbit:.1f} Mbit/s ({t.mbit / mbit:.1%} of the shaped rate)"
            )
    print(f"torn down: no namespace of {lab.tag} is left" if not _of(lab.tag) else "LEFTOVERS")
    return 0


def _of(tag: str) -> list[str]:
    return [ns for ns in namespaces() if ns.startswith(tag + "-")]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--demo", action="store_true", help="two hosts, the shaped rate measured")
    what.add_argument("--cleanup", action="store_true", help="delete leftovers of dead labs")
    what.add_argument("--recv", nargs=2, metavar=("IP", "PORT"), help=argparse.SUPPRESS)
    what.add_argument("--send", nargs=2, metavar=("IP", "PORT"), help=argparse.SUPPRESS)
    p.add_argument(
        "--tag",
        action="append",
        help="--cleanup: only the lab of this tag (aps{pid}x{n}); may be repeated",
    )
    p.add_argument("--mbit", type=_positive, default=100.0, help="--demo's links (default: 100)")
    p.add_argument("--seconds", type=_positive, default=2.0, help="--demo's transfers, --send's")
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.recv:
        return _receive(args.recv[0], int(args.recv[1]))
    if args.send:
        return _send(args.send[0], int(args.send[1]), args.seconds, args.bytes)
    try:
        if args.cleanup:
            reason = requirements()
            if reason:
                raise NetLabUnavailable(reason)
            removed = cleanup(args.tag)
            print(f"removed {len(removed)} namespaces: {' '.join(removed)}" if removed else "none")
            return 0
        return demo(args.mbit, args.seconds)
    except NetLabUnavailable as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the lab was torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
