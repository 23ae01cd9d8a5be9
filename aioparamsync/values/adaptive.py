"""Adaptive synchronization: which encoding a call should use, and how stale a read may be.

Pure objects, decisions from measurements (no asyncio, no sockets, no clock:
every time is passed in), so they are tested with synthetic figures:

- :class:`Link` models a link from the calls made over it: ``seconds = rtt +
  bytes / throughput``, fitted to the last calls' (payload bytes, wall seconds).
- :class:`EncodingController` is ``encoding="auto"``: for each call it
  predicts what every encoding would cost (the link's time for its bytes plus
  the measured time to encode them) and picks the least lossy one whose cost
  keeps communication under ``target`` of a step (the compute time the worker
  spends between pushes, measured, plus the communication), or the cheapest
  when none does. Lighter encodings come back when the link is fast again.
- :class:`StalenessController` is ``staleness="auto"`` for stale-synchronous
  reads: the bound grows while reads wait for stragglers and shrinks while
  the loss stops improving.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Choice", "EncodingController", "Link", "StalenessController"]

# Calls kept per link for its fit.
SAMPLES = 16
# Weight of a new measurement in the moving averages.
EWMA = 0.3


@dataclass(frozen=True, slots=True)
class Choice:
    """An encoding to send with.

    Attributes:
        encoding: None (raw), ``"bf16"``, ``"int8"`` or ``"topk"``.
        ratio: topk's least share, else None.
    """

    encoding: str | None
    ratio: float | None = None

    def __str__(self) -> str:
        if self.encoding is None:
            return "none"
        return f"topk {self.ratio:g}" if self.encoding == "topk" else self.encoding


# From the least lossy to the most; each is tried in turn.
PUSH_CHOICES = (
    Choice(None),
    Choice("bf16"),
    Choice("int8"),
    Choice("topk", 0.1),
    Choice("topk", 0.01),
)
# A read wants the whole array, so no topk; bf16 keeps float32's range
# (and no error feedback corrects what a read loses: int8 is left out).
PULL_CHOICES = (Choice(None), Choice("bf16"))


class Link:
    """``seconds = rtt + bytes / throughput``, fitted to the last calls over a link."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=SAMPLES)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A call moved ``nbytes`` of payload (both ways) in ``seconds`` of wall time."""
        if nbytes >= 0 and seconds > 0 and math.isfinite(seconds):
            self._samples.append((nbytes, seconds))

    @property
    def known(self) -> bool:
        return bool(self._samples)

    def fit(self) -> tuple[float, float]:
        """``(rtt seconds, throughput bytes/s)``; ``(0, inf)`` before any call."""
        samples = self._samples
        if not samples:
            return 0.0, math.inf
        xs = [b for b, _ in samples]
        ys = [s for _, s in samples]
        least = min(ys)
        if max(xs) >= 2 * max(1, min(xs)) and len(samples) >= 3:
            # Sizes that differ: least squares for the line.
            n = len(xs)
            mx, my = sum(xs) / n, sum(ys) / n
            sxx = sum((x - mx) ** 2 for x in xs)
            sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
            slope = sxy / sxx if sxx > 0 else 0.0
            if slope > 0:
                rtt = min(max(my - slope * mx, 0.0), least)
                return rtt, 1.0 / slope
        # One size only: the fastest small call is the round trip; what a
        # larger one takes beyond it, its bytes.
        small = [s for b, s in samples if b <= 4096]
        rtt = min(small) if small else 0.0
        rates = sorted(b / (s - rtt) for b, s in samples if s > rtt and b > 4096)
        return rtt, rates[len(rates) // 2] if rates else math.inf

    def seconds(self, nbytes: float) -> float:
        """What moving ``nbytes`` is predicted to take."""
        rtt, throughput = self.fit()
        return rtt + (nbytes / throughput if throughput != math.inf else 0.0)


@dataclass
class _Decision:
    choice: Choice
    predicted: dict[str, float] = field(default_factory=dict)
    allowed: float = math.inf


class EncodingController:
    """``encoding="auto"``: the least lossy encoding that keeps communication under ``target``.

    Args:
        target: the share of a step communication may take, in (0, 1).
        choices: the encodings to choose among, least lossy first.
    """

    def __init__(self, target: float = 0.2, choices: tuple[Choice, ...] = PUSH_CHOICES) -> None:
        if not (isinstance(target, (int, float)) and 0.0 < target < 1.0):
            raise ValueError(f"target is a share of a step in (0, 1), not {target!r}")
        self.target = float(target)
        self.choices = choices
        self.link = Link()
        self.compute: float | None = None  # seconds of work between pushes (moving average)
        # encoding -> seconds to encode one byte of raw input (moving average)
        self._encode_cost: dict[str | None, float] = {None: 0.0}
        # (name, str(choice)) -> the share of raw bytes it sent last time
        self._sizes: dict[tuple[str, str], float] = {}
        self.last: _Decision | None = None
        self.counts: dict[str, int] = {}

    # -- measurements -------------------------------------------------------------

    def observe_call(self, nbytes: int, seconds: float) -> None:
        """A call (of this client's, any method) moved ``nbytes`` in ``seconds``."""
        self.link.observe(nbytes, seconds)

    def observe_compute(self, seconds: float) -> None:
        """The worker computed for ``seconds`` since its last push (calls not counted)."""
        if seconds >= 0 and math.isfinite(seconds):
            c = self.compute
            self.compute = seconds if c is None else (1 - EWMA) * c + EWMA * seconds

    def observe_encode(
        self, choice: Choice, raw_bytes: int, sent_bytes: int, seconds: float, name: str = ""
    ) -> None:
        """Encoding ``raw_bytes`` in ``choice`` took ``seconds`` and gave ``sent_bytes``."""
        if raw_bytes <= 0:
            return
        per_byte = max(seconds, 0.0) / raw_bytes
        old = self._encode_cost.get(choice.encoding)
        self._encode_cost[choice.encoding] = (
            per_byte if old is None else (1 - EWMA) * old + EWMA * per_byte
        )
        self._sizes[name, str(choice)] = sent_bytes / raw_bytes

    # -- the decision -------------------------------------------------------------

    def _share(self, name: str, choice: Choice, itemsize: int) -> float:
        seen = self._sizes.get((name, str(choice)))
        if seen is not None:
            return seen
        if choice.encoding is None:
            return 1.0
        if choice.encoding == "bf16":
            return 2 / itemsize
        if choice.encoding == "int8":
            return 1 / itemsize
        ratio = choice.ratio or 0.01  # topk: values and 8-byte indices, at most raw
        return min(1.0, ratio * (itemsize + 8) / itemsize)

    def choose(self, sizes: dict[str, tuple[int, int]]) -> Choice:
        """The encoding for a call of ``sizes`` (name -> (raw bytes, itemsize))."""
        allowed = math.inf
        if self.compute is not None:
            allowed = self.target / (1.0 - self.target) * self.compute
        predicted: dict[str, float] = {}
        best: Choice | None = None
        cheapest, cheapest_cost = self.choices[0], math.inf
        raw_total = sum(raw for raw, _ in sizes.values())
        for choice in self.choices:
            wire = sum(raw * self._share(n, choice, item) for n, (raw, item) in sizes.items())
            encode = self._encode_cost.get(choice.encoding)
            if encode is None:
                # Not measured yet: as if free, so that it is tried once and measured.
                encode = 0.0
            cost = self.link.seconds(wire) + encode * raw_total
            predicted[str(choice)] = cost
            if cost < cheapest_cost:
                cheapest, cheapest_cost = choice, cost
            if best is None and cost <= allowed:
                best = choice
        chosen = best if best is not None else cheapest
        self.last = _Decision(chosen, predicted, allowed)
        self.counts[str(chosen)] = self.counts.get(str(chosen), 0) + 1
        return chosen

    def stats(self) -> dict[str, Any]:
        """The link's fit, the compute time, and the last decision (for ``client.stats()``)."""
        rtt, throughput = self.link.fit()
        last = self.last
        return {
            "target": self.target,
            "rtt_seconds": rtt,
            "throughput_bytes_per_second": throughput,
            "compute_seconds": self.compute,
            "chosen": str(last.choice) if last else None,
            "predicted_seconds": dict(last.predicted) if last else {},
            "allowed_seconds": last.allowed if last else None,
            "counts": dict(self.counts),
        }


class StalenessController:
    """``staleness="auto"``: a stale-synchronous bound that adapts.

    The bound (how many versions a read may be behind) grows by one when the
    reads of the last ``window`` steps waited more than ``wait_share`` of the
    step time (stragglers make workers wait), and is halved when the loss
    over that window improved by no more than ``min_progress`` relatively while the
    bound was above ``low`` (staleness is hurting); it stays in [low, high].

    Args:
        initial: the starting bound.
        low, high: the range of the bound.
        window: steps between adjustments.
        wait_share: the share of step time spent waiting above which the bound grows.
        min_progress: the relative loss improvement over a window below which it shrinks.
    """

    def __init__(
        self,
        initial: int = 2,
        *,
        low: int = 0,
        high: int = 32,
        window: int = 10,
        wait_share: float = 0.1,
        min_progress: float = 0.0,
    ) -> None:
        if not (0 <= low <= initial <= high) or window < 1:
            raise ValueError(
                f"staleness needs 0 <= low <= initial <= high and window >= 1, not "
                f"low={low}, initial={initial}, high={high}, window={window}"
            )
        self.bound = initial
        self.low, self.high, self.window = low, high, window
        self.wait_share, self.min_progress = wait_share, min_progress
        self._waited = 0.0
        self._stepped = 0.0
        self._steps = 0
        self._losses: list[float] = []
        self._window_start_loss: float | None = None
        self.changes: list[tuple[int, int, str]] = []  # (step, new bound, why)
        self._step = 0

    def observe_step(self, seconds: float, waited: float, loss: float | None = None) -> int:
        """One step took ``seconds``, ``waited`` of them in reads; answer the bound for the next."""
        self._step += 1
        self._steps += 1
        self._stepped += max(seconds, 0.0)
        self._waited += max(waited, 0.0)
        if loss is not None and math.isfinite(loss):
            self._losses.append(loss)
        if self._steps >= self.window:
            self._adjust()
        return self.bound

    def _adjust(self) -> None:
        losses = self._losses
        hurting = False
        if len(losses) >= 2:
            start = self._window_start_loss if self._window_start_loss is not None else losses[0]
            progress = (start - losses[-1]) / abs(start) if start else 0.0
            hurting = progress <= self.min_progress
            self._window_start_loss = losses[-1]
        waiting = self._stepped > 0 and self._waited / self._stepped > self.wait_share
        if hurting and self.bound > self.low:
            self.bound = max(self.low, self.bound // 2)
            self.changes.append((self._step, self.bound, "loss stopped improving"))
        elif waiting and self.bound < self.high:
            self.bound += 1
            self.changes.append((self._step, self.bound, "reads waited for stragglers"))
        self._steps, self._stepped, self._waited, self._losses = 0, 0.0, 0.0, []

    def stats(self) -> dict[str, Any]:
        return {"bound": self.bound, "changes": list(self.changes)}
