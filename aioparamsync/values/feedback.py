"""Error feedback: what a lossy encoding left out of each gradient, added to the next.

Kept by the client, one per worker (see :meth:`ParameterClient.push_gradients
<aioparamsync.client.api.ParameterClient.push_gradients>`); pure numpy over
:mod:`.compression`'s codecs.

Why top-k needs more than error feedback. A fixed top-k ratio with error
feedback delays each coordinate it does not send until its residual is among
the largest: for a dense gradient at 1%, about 100 steps, and a gradient
that many steps late is stable only for a step about ``ratio`` times the
uncompressed one; a rule with momentum multiplies the late part by
``1 / (1 - momentum)``. So a run at a step size that converges uncompressed
can diverge compressed. Here top-k's ``ratio`` is the *least* share sent:
each push sends the largest values until what it holds back is at most
``bound`` of what there was to send, by norm (``||e|| <= bound * ||g + e||``,
the "delta-contraction" under which error feedback is proved to converge
at the uncompressed rate: Stich et al., NeurIPS'18; Karimireddy et al.,
ICML'19). The bound follows the rule (:func:`residual_bound`): 0.5 for
``sum`` and ``sgd`` without momentum, ``0.5 * (1 - momentum)`` for ``sgd``
with momentum and ``0.5 * (1 - beta1)`` for ``adam``. When the norm of what
there is to send grows past twice its least in the last pushes (a run
starting to diverge, or a noisy one at its stability edge), the bound is
halved at each such push, down to sending everything, and relaxes back 5%
per push. A push whose top-k would take more bytes than the raw array (the
indices cost 8 bytes each) goes raw.

What it costs, measured (tests/test_convergence.py prints it; a small MLP's
gradients were measured the same way): on dense gradients the bound needs
20-40% of the values at 0.5 and 75-85% at 0.05 (momentum 0.9), so top-k
goes raw for many pushes or all of them and saves little there; int8 (1/4
of the bytes, within 2x of the uncompressed loss in every measured cell)
is the better choice for them. On sparse or heavy-tailed gradients top-k
sends far fewer.

Deep Gradient Compression's momentum correction (the worker keeps the
velocity, the node applies it without its own momentum, with momentum
factor masking) was measured and not adopted: with the bound above it
converged more slowly than the node's own momentum (3.1e-3 against 3.9e-4
of the initial loss on an ill-conditioned problem) and, at a step of
``1 / L`` with momentum 0.9, still diverged at bound 0.5.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..wire import thrift
from .arrays import to_parameter, wire_dtype
from .compression import _CASTS, _is_float, _le_bytes, decode, encode

__all__ = ["ErrorFeedback", "Sent", "residual_bound"]

# The bound for a rule whose momentum is not known: that of momentum 0.9.
UNKNOWN_RULE_BOUND = 0.05
# What there is to send has grown this much above its least in the last
# NORMS pushes: the bound is halved.
GROWTH = 2.0
NORMS = 8
RELAX = 1.05
# Below this the bound is 0: everything is sent.
LEAST_BOUND = 1e-3
# A sparsity warm-up starts at this share (Deep Gradient Compression's 75% sparsity).
WARMUP_START = 0.25
_INDEX_BYTES = 8


def residual_bound(rule: Any) -> float:
    """The share of what there was to send that top-k may hold back under ``rule``.

    ``0.5 * (1 - m)`` where ``m`` is the rule's momentum (``sgd``) or
    ``beta1`` (``adam``), 0 for ``sum``; :data:`UNKNOWN_RULE_BOUND` (that of
    momentum 0.9) when ``rule`` is None.
    """
    if rule is None:
        return UNKNOWN_RULE_BOUND
    if rule.kind == "sgd":
        m = rule.momentum or 0.0
    elif rule.kind == "adam":
        m = rule.beta1 if rule.beta1 is not None else 0.9
    else:
        m = 0.0
    return 0.5 * (1.0 - m)


@dataclass(frozen=True, slots=True)
class Sent:
    """What error feedback sent of one gradient at its last push.

    Attributes:
        share: the share of the values sent (1.0 for raw and elementwise encodings).
        encoding: the encoding sent (None: raw, when top-k would have been larger).
        bound: the residual bound in force (top-k), or None.
        pushes: pushes of this name so far.
    """

    share: float
    encoding: str | None
    bound: float | None
    pushes: int


@dataclass(frozen=True, slots=True)
class _Track:
    # Replaced at every push, never changed: kept() hands out references.
    residual: np.ndarray
    bound: float | None  # the rule's bound now (lowered by growth, relaxing back), or None
    norms: tuple[float, ...]  # ||g + e|| of the last NORMS pushes
    sent: Sent


def _bounded_topk(total: np.ndarray, least: int, bound: float) -> np.ndarray:
    """The flat positions (ascending) of the fewest largest values, at least
    ``least``, that leave at most ``bound`` of ``total``'s norm behind."""
    flat = total.reshape(-1)
    n = flat.size
    energy = np.square(flat, dtype=np.float64)
    need = (1.0 - bound * bound) * float(energy.sum())
    k = min(n, max(1, least))
    while True:
        idx = np.argpartition(energy, n - k)[n - k :] if k < n else np.arange(n)
        if k == n or float(energy[idx].sum()) >= need:
            break
        k = min(n, 2 * k)
    if k > least and k < n:
        # Within 2x: sort the candidates and keep the fewest that suffice.
        order = idx[np.argsort(energy[idx])[::-1]]
        fewest = int(np.searchsorted(np.cumsum(energy[order]), need)) + 1
        idx = order[: min(k, max(least, fewest))]
    return np.sort(idx)


class ErrorFeedback:
    """Client-side error feedback for lossy encodings (fp16, bf16, int8, topk).

    Each :meth:`encode` sends ``grad + residual`` and keeps as the new
    residual what the receiver will not see: ``(grad + residual) -
    decode(sent)``. Over any number of steps, the decoded sends add up to the
    gradients' sum minus the last residual, so nothing is lost, only delayed.
    For top-k, how much may be held back is bounded (see the module's text).

    Residuals are kept per parameter name, in float64 for float64 gradients
    and float32 otherwise, with the gradient's shape; a name whose gradient
    changes shape starts over from zero. Not thread-safe; one per worker.
    """

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}

    def encode(
        self,
        name: str,
        grad: Any,
        encoding: str,
        *,
        ratio: float = 0.01,
        rule: Any = None,
        max_residual: float | None = None,
        warmup: int = 0,
    ) -> Any:
        """Encode ``grad`` plus this name's residual; keep what was not sent.

        Args:
            name: the parameter's name (the residual's key).
            grad: the gradient; a floating array (float16/32/64, bfloat16).
            encoding: one of :data:`ENCODINGS` (zlib is exact: its residual stays 0).
            ratio: topk: the least share of the values sent, in (0, 1].
            rule: the parameter's rule (the IDL's ``Rule``), for top-k's bound
                (see :func:`residual_bound`); None: not known.
            max_residual: top-k's bound instead of the rule's, in [0, 1]
                (1: exactly ``ratio``, unbounded; 0: everything).
            warmup: top-k: for this name's first ``warmup`` pushes, the least
                share falls from 25% to ``ratio`` geometrically (Deep Gradient
                Compression's sparsity warm-up); 0: none.

        Returns:
            The ``Parameter`` sent (dtype and shape of ``grad``): encoded, or
            raw where top-k would have taken more bytes.

        Raises:
            TypeError: ``grad`` is not floating.
            ValueError: an unknown encoding, a bad ratio, bound or warmup, or
                non-finite values for int8.
        """
        g = np.asarray(grad)
        if not _is_float(g.dtype):
            raise TypeError(f"{name!r}: error feedback needs a floating gradient, not {g.dtype}")
        if encoding == "topk" and not 0.0 < ratio <= 1.0:
            raise ValueError(f"{name!r}: topk ratio must be in (0, 1], got {ratio}")
        if max_residual is not None and not 0.0 <= max_residual <= 1.0:
            raise ValueError(f"{name!r}: max_residual must be in [0, 1], got {max_residual}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"{name!r}: warmup is a number of pushes >= 0, not {warmup!r}")
        work = np.float64 if g.dtype.itemsize == 8 else np.float32
        track = self._tracks.get(name)
        if track is not None and track.residual.shape != g.shape:
            track = None  # a new shape starts over
        pushes = track.sent.pushes if track is not None else 0
        with np.errstate(**_CASTS):  # inf and NaN gradients are values, as in encode
            total = g.astype(work)  # a copy: it becomes the next residual
            if track is not None:
                np.add(total, track.residual, out=total)
            norm = float(np.linalg.norm(total.reshape(-1).astype(np.float64, copy=False)))
            norms = ((track.norms if track is not None else ()) + (norm,))[-NORMS:]
            bound = None
            if encoding == "topk":
                rule_bound = max_residual if max_residual is not None else residual_bound(rule)
                if track is None or track.bound is None or max_residual is not None:
                    bound = rule_bound
                else:  # relaxing back (from 0 too: everything was sent)
                    bound = min(rule_bound, max(track.bound, LEAST_BOUND) * RELAX)
                earlier = norms[:-1]
                growing = earlier and math.isfinite(norm) and norm > GROWTH * min(earlier)
                if max_residual is None and growing:
                    bound = bound / 2
                if bound < LEAST_BOUND and max_residual is None:
                    bound = 0.0
                least = ratio
                if warmup and pushes < warmup and ratio < WARMUP_START:
                    # Geometrically from WARMUP_START down to ratio.
                    least = WARMUP_START * (ratio / WARMUP_START) ** (pushes / warmup)
                sent, share = self._topk(name, total, g.dtype, least, bound)
            else:
                # Sent in the gradient's dtype: what that cast loses is kept in the residual too.
                sent, share = encode(name, total.astype(g.dtype, copy=False), encoding), 1.0
            np.subtract(total, decode(sent).astype(work, copy=False), out=total)
        # What is not finite is not carried on: a value fp16 cannot hold was
        # sent as inf, and inf - inf would make this element NaN in every push
        # after it.
        total[~np.isfinite(total)] = 0
        self._tracks[name] = _Track(
            total,
            bound if max_residual is None else None,  # a bound given is not carried on
            norms,
            Sent(share, sent.encoding, bound, pushes + 1),
        )
        return sent

    @staticmethod
    def _topk(
        name: str, total: np.ndarray, dtype: np.dtype, least: float, bound: float
    ) -> tuple[Any, float]:
        n = total.size
        if n == 0 or bound <= 0.0:  # everything: raw (a copy: total becomes the residual)
            return to_parameter(name, total.astype(dtype)), 1.0
        idx = _bounded_topk(total, math.ceil(least * n), bound)
        k = idx.size
        itemsize = dtype.itemsize
        if k * (itemsize + _INDEX_BYTES) >= n * itemsize:
            # A copy: ``total`` becomes the residual.
            return to_parameter(name, total.astype(dtype)), 1.0
        sent = thrift.Parameter(
            name=name,
            data=_le_bytes(total.reshape(-1)[idx].astype(dtype)),
            dtype=wire_dtype(dtype),
            shape=list(total.shape),
            encoding="topk",
            indices=idx.astype("<i8").tobytes(),
        )
        return sent, k / n

    def kept(self, names: Iterable[str]) -> dict[str, Any]:
        """What is kept for ``names`` as it is now, for :meth:`restore`.

        No copy: :meth:`encode` replaces what it keeps, it never changes it.
        """
        return {name: self._tracks.get(name) for name in names}

    def restore(self, kept: Mapping[str, Any]) -> None:
        """Put back what :meth:`kept` answered (a push the node did not apply)."""
        for name, track in kept.items():
            if track is None:
                self._tracks.pop(name, None)
            else:
                self._tracks[name] = track

    def residual(self, name: str) -> np.ndarray | None:
        """A copy of the residual kept for ``name``, or ``None`` when there is none."""
        track = self._tracks.get(name)
        return None if track is None else track.residual.copy()

    def sent(self, name: str) -> Sent | None:
        """What the last push of ``name`` sent (share, encoding, bound), or None."""
        track = self._tracks.get(name)
        return None if track is None else track.sent

    def sent_all(self) -> dict[str, dict[str, Any]]:
        """:meth:`sent` of every name that has a residual, each as a dict of its fields."""
        return {
            name: {"share": s.share, "encoding": s.encoding, "bound": s.bound, "pushes": s.pushes}
            for name, track in self._tracks.items()
            if (s := track.sent) is not None
        }

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of ``name``, or every residual (``None``)."""
        if name is None:
            self._tracks.clear()
        else:
            self._tracks.pop(name, None)

    @property
    def names(self) -> Sequence[str]:
        """The names that have a residual."""
        return tuple(self._tracks)

    @property
    def nbytes(self) -> int:
        """Memory the residuals take, in bytes."""
        return sum(t.residual.nbytes for t in self._tracks.values())

    def __repr__(self) -> str:
        return f"<ErrorFeedback [{len(self._tracks)} residuals, {self.nbytes} bytes]>"
