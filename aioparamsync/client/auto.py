"""``encoding="auto"`` for one client: its controllers and what they measure.

:mod:`aioparamsync.values.adaptive` decides; this keeps, for the client, what
the decisions are made from: each measured call (payload bytes and wall
seconds), the time between pushes spent outside calls (the worker's compute),
and the raw size of each parameter read (what a pull weighs).

A link within the machine (:func:`local_link`: a Unix socket, or the node's
own loopback address) sends raw, always. There the controller's model does
not hold: it takes a call's time per byte as what an encoding saves, but on
loopback that time is this machine's own work (copies, and the node's
decoding and folding of every raw byte, which no encoding makes smaller),
not a network's; and the first push or read of each kind, measured cold
(imports, first allocations), made raw look slow and the untried encodings
free (measured on loopback, 4 x 1 MiB of float32 and 10 ms of compute: 23
of 25 pushes went int8, bf16 or top-k; bf16's first encoding, with its
import, counted 216 ns a byte, raw's first push 5.6).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import ParamSyncError
from ..values.adaptive import PULL_CHOICES, PUSH_CHOICES, EncodingController
from ..values.arrays import parse_dtype
from ..values.compression import encoded_nbytes
from .addresses import is_loopback, unix_path

__all__ = ["Auto", "local_link"]


async def local_link(client: Any) -> bool:
    """Whether ``client`` reaches its node within this machine, with nothing between.

    A Unix socket; or a loopback address that is the node's own, as its
    topology says it (a proxy or a tunnel on loopback, to a node elsewhere or
    through a slow link, is no member's address), in a cluster on loopback.
    """
    host, port = client.host, client.port
    if unix_path(host) is not None:
        return True
    if not is_loopback(host):
        return False
    try:
        members = (await client.topology()).members
    except ParamSyncError:
        return False
    dialed = any(is_loopback(m.host) and m.port == port for m in members)
    return dialed and all(is_loopback(m.host) for m in members)


class Auto:
    """The push and pull controllers of one client (made when first asked for).

    Args:
        local: the client's link is within this machine: every push and read raw.
    """

    def __init__(self, local: bool = False) -> None:
        self.local = local
        self.push: EncodingController | None = None
        self.pull: EncodingController | None = None
        self._busy = 0.0  # seconds in measured calls since the last push ended
        self._pushed_at: float | None = None  # when the last measured push ended
        self._read_sizes: dict[str, tuple[int, int]] = {}  # name -> (raw bytes, itemsize)

    @property
    def measuring(self) -> bool:
        return self.push is not None or self.pull is not None

    # -- pulls --------------------------------------------------------------------

    def pull_encoding(self, names: Iterable[str]) -> str | None:
        """The encoding for a read of ``names`` (raw until their sizes are known)."""
        if self.pull is None:
            self.pull = EncodingController(choices=PULL_CHOICES[:1] if self.local else PULL_CHOICES)
        sizes = {n: self._read_sizes[n] for n in names if n in self._read_sizes}
        return self.pull.choose(sizes).encoding if sizes else None

    def observe_read(self, params: Iterable[Any], seconds: float) -> None:
        """A read answered ``params`` in ``seconds``."""
        nbytes = 0
        for p in params:
            n = encoded_nbytes(p)
            nbytes += n
            if self.pull is not None and p.dtype and not p.encoding:
                self._read_sizes[p.name] = (n, parse_dtype(p.dtype).itemsize)
        self._observe(nbytes, seconds)

    # -- pushes -------------------------------------------------------------------

    def push_choice(
        self, grads: Mapping[str, Any], target: float
    ) -> tuple[str, float, float | None]:
        """(encoding, ratio, max_residual) for a push of ``grads`` (error feedback on)."""
        if self.push is None or target != self.push.target:
            choices = PUSH_CHOICES[:1] if self.local else PUSH_CHOICES
            controller = EncodingController(target, choices)  # (the target is checked there)
            if self.push is None:
                self.push = controller
            self.push.target = controller.target
        if self._pushed_at is not None:
            self.push.observe_compute(max(0.0, time.monotonic() - self._pushed_at - self._busy))
        sizes = {}
        for name, g in grads.items():
            a = np.asarray(g)
            sizes[name] = (a.nbytes, a.dtype.itemsize)
        choice = self.push.choose(sizes)
        if choice.encoding is not None:
            return choice.encoding, choice.ratio or 0.01, None
        # Raw, through error feedback all the same: what earlier compressed
        # pushes held back goes with it (top-k with bound 0 sends everything, raw).
        return "topk", 1.0, 0.0

    def observe_encode(self, name: str, grad: Any, sent: Any, seconds: float) -> None:
        """Encoding ``grad`` for the chosen push took ``seconds`` and gave ``sent``."""
        push = self.push
        if push is not None and push.last is not None:
            push.observe_encode(
                push.last.choice, np.asarray(grad).nbytes, encoded_nbytes(sent), seconds, name
            )

    def observe_push(self, params: Iterable[Any], seconds: float) -> None:
        """A push of ``params`` was answered in ``seconds`` (now)."""
        self._observe(sum(encoded_nbytes(p) for p in params), seconds)
        self._busy, self._pushed_at = 0.0, time.monotonic()

    def _observe(self, nbytes: int, seconds: float) -> None:
        self._busy += seconds
        for controller in (self.push, self.pull):
            if controller is not None:
                controller.observe_call(nbytes, seconds)

    def stats(self) -> dict[str, Any]:
        """``"auto"`` and ``"auto_pull"``: each controller's figures, where there is one."""
        out = {}
        if self.push is not None:
            out["auto"] = {**self.push.stats(), "local": self.local}
        if self.pull is not None:
            out["auto_pull"] = {**self.pull.stats(), "local": self.local}
        return out
