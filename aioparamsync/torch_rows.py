"""Embedding tables held by the cluster, as torch modules: pull a batch's rows, push their grads.

Import it as ``from aioparamsync import torch as ps_torch`` (``ps_torch.Embedding``,
``ps_torch.EmbeddingBag``); ``import aioparamsync`` never imports torch.

Theory of operation. A table (``ParameterClient.create_table``) may hold
millions of rows, spread over the nodes by bucket, of which one batch uses a
few hundred: the module holds no weight of its own, only the rows of the
batch at hand. A training step is::

    rows = await emb.pull(ids)   # the unique ids' rows, one pull_rows call
    out = emb(ids)               # a gather from those rows (any ids that were pulled)
    loss.backward()              # gradients land on the pulled rows (a leaf tensor)
    await emb.push()             # one push_row_gradients call; the node folds them

Made with a :class:`~aioparamsync.SyncParameterClient`, ``emb.pull(ids)`` and
``emb.push()`` block and answer the same (no ``await``), run on that
client's loop.

``pull`` makes the pulled rows a fresh leaf tensor that requires grad, of shape
``(unique ids, dim)``; the module's forward gathers from it, so ``backward``
sums the gradient of every occurrence of an id into its one row, as
``torch.nn.Embedding(sparse=True)`` coalesces its sparse gradient. ``push``
sends the gradients of the rows a forward (with grad enabled) used, and only
those: a row pulled but never used is not touched on the node, whatever the
table's rule (lazy adam would step a row pushed a zero gradient). The node
folds each row once by the table's rule (``sgd``, ``adagrad``, lazy ``adam``).
So a step through this module does to the rows what ``nn.Embedding(sparse=True)``
and ``torch.optim.SGD`` or ``Adagrad`` do to a local weight.

The rows are not a parameter of the module: they are in neither
``parameters()`` nor ``state_dict()``, so the optimizer of a model's dense
part does not step them, ``zero_grad()`` does not touch them, and
``push_state_dict``/``push_grads``/``load_into`` of the model leave them out
(the table is the state; it lives on the nodes). ``module.to(device)`` does
not move them either: ``device=`` says where pulled rows go.

Misuse is refused, before anything is sent: a forward with nothing pulled,
or with ids that were not pulled; a push with nothing pulled, or before
``backward()`` gave the rows a gradient; a pull or a push while another is
in flight on the same module. A second pull before a push replaces the first
(its gradients, if any, are dropped). A push that fails (a timeout, a node
refusing) keeps the rows and their gradients, so that it can be called again:
each pull draws one request id, which every push of those rows sends, so a
push that reached the node before the error is folded once.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]  # PyTorch (imports are absolute)

from .client.blocking import on_client
from .values.arrays import is_bfloat16
from .wire import thrift

if TYPE_CHECKING:
    from .client.api import ParameterClient
    from .client.blocking import SyncParameterClient

__all__ = ["BAG_MODES", "TABLE_OPTIONS", "Embedding", "EmbeddingBag"]

Timeout = float | EllipsisType | None

# The keyword arguments of ParameterClient.create_table that create=True passes on.
TABLE_OPTIONS = frozenset({"dtype", "init", "scale", "seed", "rule", "buckets", "row_ttl"})
# How an EmbeddingBag reduces a bag (max is left out: its gradient touches one row
# per bag and column, and the rows it does not pick would be pushed zeros).
BAG_MODES = ("sum", "mean")
# At most this many of the ids that were not pulled are named in the error.
SHOWN_IDS = 5


class _TableRows(torch.nn.Module):
    """What :class:`Embedding` and :class:`EmbeddingBag` share: the pulled rows, pull and push."""

    def __init__(
        self,
        client: ParameterClient | SyncParameterClient,
        table: str,
        dim: int,
        *,
        create: bool = False,
        device: torch.device | str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(table, str) or not table:
            raise ValueError(f"table is the name of an embedding table (a str), not {table!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim is an int >= 1 (the table's row width), not {dim!r}")
        unknown = sorted(set(options) - TABLE_OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown argument(s) {', '.join(unknown)}; create_table's are "
                f"{', '.join(sorted(TABLE_OPTIONS))}"
            )
        if options and not create:
            raise TypeError(
                f"{', '.join(sorted(options))} given with create=False: they are "
                "create_table's arguments (pass create=True to create the table)"
            )
        self.client = client
        self.table = table
        self.dim = dim
        self.device = torch.device("cpu") if device is None else torch.device(device)
        # create_table's arguments until the first pull has created the table.
        self._create: dict[str, Any] | None = dict(options) if create else None
        self._clear()
        self._busy: str | None = None  # "pull" or "push" while one is in flight

    # -- what was pulled -----------------------------------------------------------------------

    def _clear(self) -> None:
        self._rows: torch.Tensor | None = None  # (unique ids, dim), a leaf requiring grad
        self._ids: torch.Tensor | None = None  # the unique ids, sorted, on self.device
        self._used: torch.Tensor | None = None  # which rows a forward with grad used
        self._request_id: str | None = None  # every push of these rows sends it

    @property
    def rows(self) -> torch.Tensor | None:
        """The pulled rows, ``(len(pulled_ids), dim)``, a leaf tensor (None: nothing pulled)."""
        return self._rows

    @property
    def pulled_ids(self) -> torch.Tensor | None:
        """The unique ids pulled, sorted (row ``i`` of :attr:`rows` is id ``pulled_ids[i]``)."""
        return self._ids

    def extra_repr(self) -> str:
        pulled = "nothing pulled" if self._rows is None else f"{len(self._rows)} rows pulled"
        if self._rows is not None:
            pulled += ", grad" if self._rows.grad is not None else ", no grad"
        return f"table={self.table!r}, dim={self.dim}, {pulled}"

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if self._busy is not None:
            raise RuntimeError(
                f"{type(self).__name__} {self.table!r}: cannot {what}: a {self._busy} is in "
                "progress on this module (await it first)"
            )
        self._busy = what
        try:
            yield
        finally:
            self._busy = None

    def _as_ids(self, ids: Any, what: str) -> torch.Tensor:
        """``ids`` as an int64 tensor of its shape (not copied where it already is one)."""
        # (A copy of anything else: torch warns of a read-only array, and it is small.)
        t = ids if isinstance(ids, torch.Tensor) else torch.from_numpy(np.array(ids))
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise TypeError(f"{what}: ids are integers (a LongTensor), not {t.dtype}")
        return t.detach().to(torch.int64)

    # -- pull and push --------------------------------------------------------------------------

    def pull(self, ids: Any, *, encoding: str | None = None, timeout: Timeout = ...) -> Any:
        """Fetch the rows of a batch's ids, each id once, in one call; forward gathers from them.

        Whatever was pulled before is dropped first (gradients not pushed
        included), even if this pull then fails. With ``create=True``, the
        first pull creates the table (the same table again is no error).

        Args:
            ids: the batch's ids, any shape (a LongTensor, or a numpy array
                or list of integers); repeats are pulled once.
            encoding: the rows' encoding on the wire (``"fp16"``, ``"bf16"``,
                ``"int8"``; None: the table's dtype). The rows are answered in
                the table's dtype whatever it is.
            timeout: the call's deadline (seconds; default: the client's).

        Returns:
            The pulled rows (to await, with a ParameterClient): a new leaf
            tensor of the table's dtype on ``device``, ``(unique ids, dim)``,
            requiring grad (also :attr:`rows`; :attr:`pulled_ids` says which
            id each row is).

        Raises:
            TypeError: ids that are not integers.
            ValueError: the table's rows are not ``dim`` wide.
            RuntimeError: a pull or push on this module is in flight.
            RequestError: no such table (create it, or pass ``create=True``),
                or the node refused.
            CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
        """
        return on_client(self.client, self._pull, ids, encoding=encoding, timeout=timeout)

    async def _pull(
        self, client: ParameterClient, ids: Any, *, encoding: str | None, timeout: Timeout
    ) -> torch.Tensor:
        flat = self._as_ids(ids, "pull").reshape(-1).cpu()
        with self._exclusive("pull"):
            self._clear()
            if self._create is not None:
                await client.create_table(self.table, self.dim, timeout=timeout, **self._create)
                self._create = None
            unique = torch.unique(flat)  # sorted: forward finds ids by binary search
            if len(unique):
                answer = await client.pull_rows(
                    self.table, unique.numpy(), encoding=encoding, timeout=timeout
                )
                if answer.ndim != 2 or answer.shape[1] != self.dim:
                    raise ValueError(
                        f"table {self.table!r} has rows of width {answer.shape[-1]}, "
                        f"this {type(self).__name__} was made with dim={self.dim}"
                    )
                rows = _tensor_of(answer)
            else:
                rows = torch.empty(0, self.dim)
            rows = rows.to(self.device).requires_grad_()
            self._rows, self._ids = rows, unique.to(self.device)
            self._used = torch.zeros(len(unique), dtype=torch.bool, device=self.device)
            self._request_id = uuid.uuid4().hex
        return rows

    def push(
        self,
        *,
        encoding: str | None = None,
        acks: str | None = None,
        timeout: Timeout = ...,
    ) -> Any:
        """Send the gradients of the rows this batch's forward used, in one call; then clear.

        Each row used is sent once, with the gradient ``backward()`` summed
        into it over every occurrence of its id (and every forward since the
        pull); the node folds it by the table's rule. Rows pulled but not
        used by a forward with grad enabled are not sent. After it, the
        module holds nothing pulled until the next :meth:`pull`. If it
        raises, the rows and their gradients are kept: call it again (it
        sends the same request id, so the node folds the push once).

        Args:
            encoding: the gradients' encoding on the wire (``"fp16"``,
                ``"bf16"``, ``"int8"``; None: as they are).
            acks: ``"1"`` (the default) or ``"all"`` (answered once every
                replica holds the fold), as ``push_row_gradients`` takes it.
            timeout: the call's deadline (seconds; default: the client's).

        Returns:
            The IDL's ``RowsResult`` (to await, with a ParameterClient):
            ``rows`` folded, ``created`` by this push (both 0 when no row was
            used: then nothing is sent).

        Raises:
            RuntimeError: nothing pulled (call :meth:`pull` first; a push
                clears what it sent), or a pull or push in flight.
            ValueError: the rows have no gradient (call ``loss.backward()``
                first): nothing is sent.
            RequestError: the node refused (e.g. non-finite gradients); nothing
                of the part it refused was folded.
            CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
        """
        return on_client(self.client, self._push, encoding=encoding, acks=acks, timeout=timeout)

    async def _push(
        self, client: ParameterClient, *, encoding: str | None, acks: str | None, timeout: Timeout
    ) -> Any:
        rows, ids, used = self._rows, self._ids, self._used
        if rows is None or ids is None or used is None:
            raise RuntimeError(
                f"{type(self).__name__} {self.table!r}: nothing pulled to push "
                "(await pull(ids), forward, backward, then push; a push clears what it sent)"
            )
        if rows.grad is None:
            raise ValueError(
                f"{type(self).__name__} {self.table!r}: the pulled rows have no gradient: "
                "call loss.backward() before push() (nothing was sent)"
            )
        with self._exclusive("push"):
            where = used.nonzero().reshape(-1)
            if len(where):
                result = await client.push_row_gradients(
                    self.table,
                    ids[where].cpu().numpy(),
                    _array_of(rows.grad[where]),
                    encoding=encoding,
                    request_id=self._request_id,
                    acks=acks,
                    timeout=timeout,
                )
            else:
                result = thrift.RowsResult(rows=0, created=0)
            self._clear()
        return result

    # -- forward ----------------------------------------------------------------------------------

    def _index(self, ids: Any) -> torch.Tensor:
        """The row of each id (ids' shape, on ``device``); marks the rows used."""
        rows, unique, used = self._rows, self._ids, self._used
        if rows is None or unique is None or used is None:
            raise RuntimeError(
                f"{type(self).__name__} {self.table!r}: no rows pulled: "
                "await pull(ids) with this batch's ids before the forward"
            )
        t = self._as_ids(ids, "forward").to(self.device)
        flat = t.reshape(-1)
        if len(unique) == 0:
            found = torch.zeros_like(flat, dtype=torch.bool)
            position = torch.zeros_like(flat)
        else:
            position = torch.searchsorted(unique, flat).clamp_(max=len(unique) - 1)
            found = unique[position] == flat
        if not bool(found.all()):
            missing = torch.unique(flat[~found])
            shown = ", ".join(str(int(i)) for i in missing[:SHOWN_IDS])
            more = f" and {len(missing) - SHOWN_IDS} more" if len(missing) > SHOWN_IDS else ""
            raise ValueError(
                f"{type(self).__name__} {self.table!r}: {len(missing)} id(s) were not pulled "
                f"({shown}{more}): await pull(ids) with this batch's ids before the forward"
            )
        if torch.is_grad_enabled():
            used[position] = True
        return position.reshape(t.shape)


class Embedding(_TableRows):
    """A lookup table held by the cluster: ``emb(ids)`` is the rows of ``ids``, as nn.Embedding's.

    Used inside a normal torch model, whose dense part has a normal optimizer::

        emb = ps_torch.Embedding(client, "user", 16)
        await emb.pull(ids)          # before each forward: the batch's unique ids' rows
        loss = criterion(head(emb(ids)), labels)
        loss.backward()
        optimizer.step()             # the dense part (the rows are not its parameters)
        await emb.push()             # the rows' gradients, folded on the node

    See :mod:`aioparamsync.torch_rows` for what pull, forward and push each do.

    Args:
        client: the client to pull and push with (a routed client of the
            cluster cuts each call by the node each row's bucket lives on); a
            :class:`~aioparamsync.SyncParameterClient` makes pull and push block.
        table: the table's name.
        dim: its row width (checked at the first pull).
        create: create the table at the first pull (an existing one, made
            with the same arguments, is no error); else it must exist.
        device: where pulled rows are put (default: the CPU); the ids given
            to forward are moved there.
        **options: with ``create=True``, create_table's arguments: ``dtype``,
            ``init``, ``scale``, ``seed``, ``rule``, ``buckets``, ``row_ttl``.

    Raises:
        ValueError: an empty table name, a dim that is not an int >= 1.
        TypeError: an unknown option, or options without ``create=True``.
    """

    def forward(self, ids: Any) -> torch.Tensor:
        """The rows of ``ids``: shape ``ids.shape + (dim,)``.

        Every id must have been pulled by the last :meth:`pull` (the same ids,
        or any of them: one pull may serve several lookups).

        Raises:
            RuntimeError: nothing pulled (or pushed since).
            ValueError: ids that were not pulled (up to 5 are named).
            TypeError: ids that are not integers.
        """
        index = self._index(ids)
        assert self._rows is not None
        return torch.nn.functional.embedding(index, self._rows)


class EmbeddingBag(_TableRows):
    """Sums or means of bags of rows of a table held by the cluster, as nn.EmbeddingBag's.

    ``bag(ids)`` with 2-D ids ``(bags, per bag)``, or ``bag(ids, offsets)``
    with 1-D ids and the index in ``ids`` where each bag starts (an empty bag
    gives zeros); ``(bags, dim)`` either way. Pull and push as
    :class:`Embedding`'s (the ids pulled are those of every bag).

    Args:
        mode: ``"sum"`` or ``"mean"`` of each bag's rows.
        client, table, dim, create, device, **options: as :class:`Embedding`'s.

    Raises:
        ValueError: an unknown mode; and as :class:`Embedding`.
    """

    def __init__(
        self,
        client: ParameterClient | SyncParameterClient,
        table: str,
        dim: int,
        *,
        mode: str = "mean",
        create: bool = False,
        device: torch.device | str | None = None,
        **options: Any,
    ) -> None:
        if mode not in BAG_MODES:
            raise ValueError(f"mode is one of {', '.join(BAG_MODES)}, not {mode!r}")
        super().__init__(client, table, dim, create=create, device=device, **options)
        self.mode = mode

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"

    def forward(
        self, ids: Any, offsets: Any = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each bag's sum or mean of rows: ``(bags, dim)``.

        Args:
            ids: 2-D ``(bags, per bag)``, or 1-D with ``offsets``.
            offsets: with 1-D ids, where each bag starts (1-D integers,
                non-decreasing, the first 0).
            per_sample_weights: with ``mode="sum"``, a weight per id (ids' shape).

        Raises:
            ValueError: 1-D ids without offsets, or 2-D ids with them; ids
                that were not pulled; and as :meth:`Embedding.forward`.
        """
        index = self._index(ids)
        assert self._rows is not None
        if index.dim() == 1 and offsets is None:
            raise ValueError("1-D ids need offsets (where each bag starts), or give 2-D ids")
        if index.dim() == 2 and offsets is not None:
            raise ValueError("2-D ids are one bag per row: they take no offsets")
        if index.dim() not in (1, 2):
            raise ValueError(f"ids are 1-D (with offsets) or 2-D, not {index.dim()}-D")
        if offsets is not None:
            offsets = self._as_ids(offsets, "forward").to(self.device)
        return torch.nn.functional.embedding_bag(
            index, self._rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights
        )


def _tensor_of(rows: np.ndarray) -> torch.Tensor:
    """A new CPU tensor of received rows (read-only bytes: copied), bfloat16 included."""
    if is_bfloat16(rows.dtype):
        return torch.from_numpy(np.array(rows, copy=True).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(rows, dtype=rows.dtype.newbyteorder("="), copy=True))


def _array_of(grad: torch.Tensor) -> np.ndarray:
    """A tensor's values as a CPU numpy array, to send (bfloat16 as ml_dtypes')."""
    t = grad.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
