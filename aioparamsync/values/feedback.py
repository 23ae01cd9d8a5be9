"""Error feedback: what a lossy encoding left out of each gradient, added to the next.

Kept by the client, one per worker (see :meth:`ParameterClient.push_gradients
<aioparamsync.client.api.ParameterClient.push_gradients>`); pure numpy over
:mod:`.compression`'s codecs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .compression import _CASTS, _is_float, decode, encode

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Client-side error feedback for lossy encodings (fp16, bf16, int8, topk).

    Each :meth:`encode` sends ``grad + residual`` and keeps as the new
    residual what the receiver will not see: ``(grad + residual) -
    decode(sent)``. Over any number of steps, the decoded sends add up to the
    gradients' sum minus the last residual, so nothing is lost, only delayed.

    Residuals are kept per parameter name, in float64 for float64 gradients
    and float32 otherwise, with the gradient's shape; a name whose gradient
    changes shape starts over from zero. Not thread-safe; one per worker.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, np.ndarray] = {}

    def encode(self, name: str, grad: Any, encoding: str, *, ratio: float = 0.01) -> Any:
        """Encode ``grad`` plus this name's residual; keep what was not sent.

        Args:
            name: the parameter's name (the residual's key).
            grad: the gradient; a floating array (float16/32/64, bfloat16).
            encoding: one of :data:`ENCODINGS` (zlib is exact: its residual stays 0).
            ratio: topk: the fraction of elements to send, in (0, 1].

        Returns:
            The encoded ``Parameter`` (dtype and shape of ``grad``).

        Raises:
            TypeError: ``grad`` is not floating.
            ValueError: an unknown encoding or bad ratio, or non-finite values for int8.
        """
        g = np.asarray(grad)
        if not _is_float(g.dtype):
            raise TypeError(f"{name!r}: error feedback needs a floating gradient, not {g.dtype}")
        work = np.float64 if g.dtype.itemsize == 8 else np.float32
        residual = self._residuals.get(name)  # of dtype work, when there is one
        with np.errstate(**_CASTS):  # inf and NaN gradients are values, as in encode
            total = g.astype(work)  # a copy: it becomes the next residual
            if residual is not None and residual.shape == g.shape:
                np.add(total, residual, out=total)
            # Sent in the gradient's dtype: what that cast loses is kept in the residual too.
            sent = encode(name, total.astype(g.dtype, copy=False), encoding, ratio=ratio)
            np.subtract(total, decode(sent).astype(work, copy=False), out=total)
        # What is not finite is not carried on: a value fp16 cannot hold was
        # sent as inf, and inf - inf would make this element NaN in every push
        # after it.
        total[~np.isfinite(total)] = 0
        self._residuals[name] = total
        return sent

    def kept(self, names: Iterable[str]) -> dict[str, np.ndarray | None]:
        """The residuals of ``names`` as they are now, for :meth:`restore`.

        No copy: :meth:`encode` replaces a residual, it never changes one.
        """
        return {name: self._residuals.get(name) for name in names}

    def restore(self, kept: Mapping[str, np.ndarray | None]) -> None:
        """Put back the residuals :meth:`kept` answered (a push the node did not apply)."""
        for name, residual in kept.items():
            if residual is None:
                self._residuals.pop(name, None)
            else:
                self._residuals[name] = residual

    def residual(self, name: str) -> np.ndarray | None:
        """A copy of the residual kept for ``name``, or ``None`` when there is none."""
        residual = self._residuals.get(name)
        return None if residual is None else residual.copy()

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of ``name``, or every residual (``None``)."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    @property
    def names(self) -> Sequence[str]:
        """The names that have a residual."""
        return tuple(self._residuals)

    @property
    def nbytes(self) -> int:
        """Memory the residuals take, in bytes."""
        return sum(r.nbytes for r in self._residuals.values())

    def __repr__(self) -> str:
        return f"<ErrorFeedback [{len(self._residuals)} residuals, {self.nbytes} bytes]>"
