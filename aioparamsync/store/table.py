"""The parameter table: every parameter and every rule of changing it (no asyncio).

Theory of operation. :class:`ParameterTable` holds the parameters and every
rule of changing them (validation, layouts, casts, versions, timestamps,
last-writer-wins; what each parameter must be, :mod:`.checks`); it has no
asyncio in it and is tested without an event loop. One caller at a time
changes it: the store's single writer (:mod:`aioparamsync.store.writer`).

Reads need no lock and no copy. A read runs between two of the writer's
steps on the same event loop, so it sees every update wholly or not at all,
and the :class:`Entry` objects it collects are immutable: an update replaces
entries, it never changes one. Their ``data`` is a read-only view of the
bytes the update arrived in.

A name is held whole (under the name) or as partitions (its manifest, under
:func:`~aioparamsync.placement.manifest_key`, placed with the name), never
both: the two keys are one parameter's, so of the two the one with the
larger ``(version, origin)`` stands (:func:`lww_key`; at equal keys, the
manifest), and storing it removes the other, in the same step. So a
parameter changes between whole and partitions atomically where its name is
held, and its replicas converge on the same one whatever the order in which
updates reach them. An update of either key makes its version exceed the
other's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._ext import compiled
from ..errors import ErrorCode, RequestError
from ..placement import manifest_key, parse_key
from ..values import rules
from ..values.arrays import (
    BFLOAT16,
    SWAP_BFLOAT16,
    check_layout,
    dtype_name,
    from_parameter,
    is_bfloat16,
)
from ..wire import thrift
from .buffers import kept, partitions_together, together_of
from .checks import (
    cast_to,
    check_cast,
    check_keeps_layout,
    check_names,
    check_rule_fits,
)

__all__ = ["Applied", "Entry", "Limits", "ParameterTable", "lww_key"]

# The largest version a parameter may have (Thrift's i32).
MAX_VERSION = 2**31 - 1


def lww_key(item: Any) -> tuple[int, str]:
    """What last-writer-wins compares, everywhere: ``(version, origin)``.

    Of two values of one parameter, the one with the larger key wins (a
    larger version; at equal versions, the larger origin), so that every
    node, whatever order it sees them in, keeps the same one. ``item`` is an
    :class:`Entry`, a ``Parameter`` or a ``DigestEntry``.
    """
    return (item.version or 0, item.origin or "")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may hold."""

    max_name_bytes: int = 1024
    max_params_per_update: int = 100_000
    max_names_per_request: int = 100_000


@dataclass(frozen=True, slots=True, init=False)
class Entry:
    """One stored parameter; never changed once made.

    Attributes:
        name: its name.
        data: its bytes, a read-only buffer.
        version: its version (grows with every update).
        dtype: numpy's dtype string, or None for plain bytes.
        shape: its shape, or None.
        origin: the id of the node where this version was first applied.
        rule: the rule gradients are folded in by (the IDL's ``Rule``), or None.
        array: its data as the array it is (a view; None until a fold needs it),
            kept for the next fold (making it again takes as long as a small fold).
    """

    name: str
    data: memoryview
    version: int
    dtype: str | None
    shape: tuple[int, ...] | None
    origin: str
    rule: Any = None
    array: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __init__(
        self,
        name: str,
        data: memoryview,
        version: int,
        dtype: str | None,
        shape: tuple[int, ...] | None,
        origin: str,
        rule: Any = None,
        array: np.ndarray | None = None,
    ) -> None:
        # A frozen dataclass's own __init__ sets each field by object.__setattr__;
        # setting the slots directly takes half the time (one Entry per update).
        _set_entry_name(self, name)
        _set_entry_data(self, data)
        _set_entry_version(self, version)
        _set_entry_dtype(self, dtype)
        _set_entry_shape(self, shape)
        _set_entry_origin(self, origin)
        _set_entry_rule(self, rule)
        _set_entry_array(self, array)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def to_parameter(self, rule: bool = True) -> Any:
        """The wire's ``Parameter`` for this entry (its data by reference, not copied);
        ``rule=False``: without its rule."""
        return thrift.Parameter(
            name=self.name,
            data=self.data,
            version=self.version,
            dtype=self.dtype,
            shape=list(self.shape) if self.shape is not None else None,
            origin=self.origin,
            rule=self.rule if rule else None,
        )


def _fits(g: Any, dtype: str | None, weights: np.ndarray) -> bool:
    """True if the gradient ``g`` has the dtype string and the shape of its parameter
    (``dtype``, ``weights``) and their bytes, and is read as it is (not byte-swapped):
    it may be read at once, without from_parameter's checks (which say what does not fit)."""
    shape = g.shape
    if g.dtype != dtype or shape is None or len(shape) != weights.ndim:
        return False
    if tuple(shape) != weights.shape or memoryview(g.data).nbytes != weights.nbytes:
        return False
    return not (SWAP_BFLOAT16 and dtype == BFLOAT16)  # (bfloat16 swapped: from_parameter)


def _like(g: Any, weights: np.ndarray) -> np.ndarray:
    """The gradient ``g`` that :func:`_fits` its parameter's ``weights``, as an array."""
    grad = np.frombuffer(g.data, dtype=weights.dtype)
    return grad if weights.ndim == 1 else grad.reshape(weights.shape)


_set_entry_name = vars(Entry)["name"].__set__
_set_entry_data = vars(Entry)["data"].__set__
_set_entry_version = vars(Entry)["version"].__set__
_set_entry_dtype = vars(Entry)["dtype"].__set__
_set_entry_shape = vars(Entry)["shape"].__set__
_set_entry_origin = vars(Entry)["origin"].__set__
_set_entry_rule = vars(Entry)["rule"].__set__
_set_entry_array = vars(Entry)["array"].__set__

# The new entries of a push's compiled fold (see store/_centry.pyx): Entry's objects, made
# without a frame of its __init__ (as long again as a small tensor's fold); on the pure path,
# Entry.
_centry = compiled("store._centry")
_MAKE_ENTRY: Any = _centry.EntryMaker(Entry) if _centry is not None else Entry


@dataclass(frozen=True, slots=True, init=False)
class Applied:
    """What one update did: the entries it stored and the node's timestamp after it."""

    entries: tuple[Entry, ...]
    timestamp: int

    def __init__(self, entries: tuple[Entry, ...], timestamp: int) -> None:
        _set_applied_entries(self, entries)  # (as Entry.__init__)
        _set_applied_timestamp(self, timestamp)


_set_applied_entries = vars(Applied)["entries"].__set__
_set_applied_timestamp = vars(Applied)["timestamp"].__set__


def _manifest_of(key: str) -> str | None:
    """The name ``key`` is the manifest of, or None (a name, a partition, another key)."""
    parsed = parse_key(key)
    return parsed[0] if parsed is not None and parsed[1] is None else None


def _stands(held: Any, given: Any) -> bool:
    """Whether ``held`` stands against ``given``, the other key of its parameter (see the
    module): the larger ``lww_key``; at equal ones, the manifest."""
    return (lww_key(held), "\x00" in held.name) >= (lww_key(given), "\x00" in given.name)


class ParameterTable:
    """Every parameter and the rules of changing them (no asyncio; one caller at a time).

    Args:
        node_id: this node's id.
        origin: recorded as the origin of the versions this node applies
            (default: ``node_id``; a node adds its incarnation, see :class:`Node`).
        limits: what one request may hold.
    """

    def __init__(
        self, node_id: str = "", limits: Limits | None = None, *, origin: str = ""
    ) -> None:
        self.node_id = node_id
        self._origin = origin
        self.limits = limits or Limits()
        self.timestamp = 0
        self._entries: dict[str, Entry] = {}
        self._nbytes = 0
        self._manifests = 0  # manifests held (none: a name has no other key to look up)
        # What each parameter's rule keeps between gradient steps (this node's
        # own: optimizer state is not replicated).
        self._states: dict[str, rules.State] = {}
        #: copies from before: read from the data directory at start, or kept through a
        #: lost lease (name -> lww key; see recovered_entry)
        self.recovered: dict[str, tuple[int, str]] = {}

    @property
    def origin(self) -> str:
        return self._origin or self.node_id

    @origin.setter
    def origin(self, value: str) -> None:
        self._origin = value

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return (
            f"<ParameterTable {len(self)} parameters, {self._nbytes} bytes, "
            f"timestamp {self.timestamp}>"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of parameter data held."""
        return self._nbytes

    def entry(self, name: str) -> Entry | None:
        return self._entries.get(name)

    @property
    def by_name(self) -> Mapping[str, Entry]:
        """Every entry by name, as held now (read only: the table makes every change)."""
        return self._entries

    @property
    def holds_manifests(self) -> bool:
        """Whether a parameter is held as partitions here (its manifest is)."""
        return self._manifests > 0

    def put(self, made: list[Entry], timestamp: int) -> Applied:
        """Store entries made as :meth:`apply` makes them, checked as it checks them (a
        founding client's small update, in C: see ``ParameterStore.applied_now``)."""
        return self._store(made, timestamp)

    def mark_recovered(self) -> None:
        """Remember every entry held now as a copy from before: read from the data
        directory at start, or kept through a lost lease (see
        :mod:`aioparamsync.cluster.recovered`, which yields such copies to live ones)."""
        self.recovered = {name: lww_key(e) for name, e in self._entries.items()}

    def recovered_entry(self, name: str) -> Entry | None:
        """``name``'s entry while it is as :meth:`mark_recovered` found it, nothing
        written to it since; else None (and the name is forgotten)."""
        key = self.recovered.get(name)
        if key is None:
            return None
        e = self._entries.get(name)
        if e is not None and lww_key(e) == key:
            return e
        del self.recovered[name]
        return None

    def lift(self, floors: Mapping[str, int], timestamp: int) -> Applied:
        """Raise each named parameter's version to its floor where it is lower, its
        value, layout and rule kept (a write here: it replicates, and is logged, as any)."""
        made = []
        for name, floor in floors.items():
            e = self._entries.get(name)
            if e is not None and e.version < floor <= MAX_VERSION:
                made.append(
                    Entry(name, e.data, floor, e.dtype, e.shape, self.origin, e.rule, e.array)
                )
        return self._store(made, timestamp)

    def names(self) -> list[str]:
        return list(self._entries)

    def read(self, names: Sequence[str], min_version: int = 0) -> list[Entry]:
        """The entries of ``names`` that exist with ``version >= min_version``, in order.

        Names that do not qualify are left out; a name asked twice comes once.

        Raises:
            RequestError: (LIMIT_EXCEEDED) too many names.
        """
        if len(names) > self.limits.max_names_per_request:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{len(names)} names in one request; the limit is "
                f"{self.limits.max_names_per_request}",
            )
        entries = self._entries
        found = []
        seen = set()
        for name in names:
            entry = entries.get(name)
            if entry is not None and entry.version >= min_version and name not in seen:
                seen.add(name)
                found.append(entry)
        return found

    def partner(self, key: str) -> str | None:
        """The other key of ``key``'s parameter (a name's manifest, a manifest's name), or None.

        None too for a name when no manifest is held (nothing to look up).
        """
        if "\x00" in key:
            return _manifest_of(key)
        return manifest_key(key) if self._manifests else None

    def check(self, params: Sequence[Any], *, replicated: bool = False) -> None:
        """Raise :class:`RequestError` if the update ``params`` may not be applied."""
        check_names(self.limits, params, what="parameters")
        partitioned = []  # the names of the manifests among params
        for p in params:
            name = p.name
            if "\x00" in name and (whole := _manifest_of(name)) is not None:
                partitioned.append(whole)
            if p.data is None:
                raise RequestError(ErrorCode.BAD_REQUEST, f"{name!r} has no data")
            if p.encoding or p.total_bytes is not None:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"{name!r}: encoded data, or a piece, reached the store (a node decodes "
                    "and puts together first)",
                )
            data = p.data
            nbytes = data.nbytes if type(data) is memoryview else memoryview(data).nbytes
            check_layout(name, nbytes, p.dtype, p.shape)
            if p.rule is not None:
                check_rule_fits(name, p.rule, p.dtype)
            if replicated:
                if not p.origin or not p.version or p.version < 1:
                    raise RequestError(
                        ErrorCode.BAD_REQUEST,
                        f"replicated {name!r} needs an origin and a positive version",
                    )
                continue
            current = self._entries.get(name)
            if current is None:
                continue
            if current.version >= MAX_VERSION:
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED, f"{name!r} has reached the largest version"
                )
            if current.dtype is not None and not p.replace:
                check_keeps_layout(
                    current, nbytes, p.dtype, p.shape, lossy=getattr(p, "lossy", False)
                )
        if partitioned and not replicated and (both := set(partitioned) & {p.name for p in params}):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{sorted(both)[0]!r} is both whole and as partitions in one update",
            )

    def apply(self, params: Sequence[Any], timestamp: int) -> Applied:
        """Apply one update wholly, or raise :class:`RequestError` and change nothing.

        Each parameter's version becomes ``max(stored + 1, given)``; the
        node's timestamp becomes ``max(timestamp, given timestamp)``.
        """
        self.check(params)
        entries = self._entries
        together = partitions_together(params) if len(params) > 1 else {}
        made = []
        replaced = []  # the other keys of parameters written (see the module)
        for p in params:
            current = entries.get(p.name)
            stored = current.version if current is not None else 0
            if self._manifests or "\x00" in p.name:  # (else no other key: see partner)
                partner = self.partner(p.name)
                if partner is not None and (other := entries.get(partner)) is not None:
                    stored = max(stored, other.version)  # (it replaces the other: see the module)
                    replaced.append(partner)
            given = p.version or 0
            dtype = p.dtype
            shape = tuple(p.shape) if p.shape is not None else None
            data = p.data
            if current is not None and current.dtype is not None and not p.replace:
                # An update keeps the layout (check() saw that it fits): plain
                # bytes (a founding client's) of the stored size take it whole,
                # an array given without a shape takes the stored shape, and a
                # lossy-encoded one of a wider dtype is cast to the stored one.
                if dtype is not None and dtype != current.dtype:
                    data = cast_to(p, current)
                dtype, shape = current.dtype, current.shape
            rule = p.rule if p.rule is not None else (current.rule if current else None)
            if rule is not None and p.rule is None and p.replace:
                try:  # the stored rule must fit the new layout (a kept one fits)
                    check_rule_fits(p.name, rule, dtype)
                except RequestError:
                    rule = None  # e.g. floats replaced by bytes: no rule applies
            made.append(
                Entry(
                    p.name,
                    kept(data, together_of(together, p.name, data)),
                    max(stored + 1, given),
                    dtype,
                    shape,
                    self.origin,
                    rule,
                )
            )
        return self._store(made, timestamp, replaced)

    def fold(self, grads: Sequence[Any], timestamp: int) -> Applied:
        """Fold gradients into their parameters by each one's rule, wholly or not at all.

        Each gradient (a decoded ``Parameter``) must name a stored parameter
        that has a rule, and have its shape and a dtype that converts to the
        parameter's without loss (an int32 parameter takes no float gradient,
        a float32 one no float64 gradient), unless the gradient came in a
        lossy encoding (the node's decoder sets its ``lossy``): then floats
        may narrow, but a gradient still never changes kind. Versions grow by
        one; the new values replicate like any update.

        Raises:
            RequestError: a gradient may not be folded (nothing is changed).
        """
        limits = self.limits
        quick = None
        if len(grads) <= limits.max_params_per_update:  # (check_names says so, below)
            quick = rules.fold_entries(
                grads,
                self._entries,
                self._states,
                self.origin,
                entry=_MAKE_ENTRY,
                max_version=MAX_VERSION,
                max_name_bytes=limits.max_name_bytes,
            )
        done, states, rest = quick if quick is not None else ({}, {}, range(len(grads)))
        if not rest:  # (all compiled: each replaces an entry of its name, rule, dtype,
            # shape and bytes, so _store's accounting is unchanged)
            self._entries.update(done)
            self._states.update(states)
            if timestamp > self.timestamp:
                self.timestamp = timestamp
            return Applied(tuple(done.values()), self.timestamp)
        # The rest, checked (and all the names), each folded by fold_into; all computed
        # before any is stored.
        check_names(limits, grads, what="gradients")
        work = self._gradients([grads[i] for i in rest], finite=False)
        kept = self._states
        with np.errstate(all="ignore"):  # (once for all: see rules.fold_into)
            for current, weights, grad in work:
                name = current.name
                value, states[name] = rules.fold_into(
                    current.rule, weights, grad, kept.get(name), check=name
                )
                value.flags.writeable = False
                # ours alone (new, C-contiguous): the entry keeps its bytes, uncopied
                flat = value if value.ndim == 1 else value.reshape(-1)
                done[name] = Entry(
                    name,
                    flat.data.cast("B"),
                    current.version + 1,
                    current.dtype,
                    current.shape,
                    self.origin,
                    current.rule,
                    value,
                )
        kept.update(states)
        return self._store([done[g.name] for g in grads], timestamp)

    def check_gradients(self, grads: Sequence[Any], *, finite: bool = True) -> None:
        """Raise :class:`RequestError` if ``grads`` may not be folded now (see :meth:`fold`).

        A gradient holding NaN or inf is refused unless its parameter's rule
        allows them (see :func:`~aioparamsync.values.rules.check_finite`);
        ``finite=False`` leaves that to the caller.
        """
        check_names(self.limits, grads, what="gradients")
        self._gradients(grads, finite=finite)

    def _gradients(
        self, grads: Sequence[Any], *, finite: bool
    ) -> list[tuple[Entry, np.ndarray, np.ndarray]]:
        """Each of ``grads`` (names checked) checked: its parameter's entry, the
        parameter's array, the gradient's (see :meth:`check_gradients`)."""
        entries = self._entries
        work = []
        for g in grads:
            current = entries.get(g.name)
            if current is None:
                raise RequestError(ErrorCode.UNKNOWN_PARAMETER, f"no parameter {g.name!r}")
            if current.rule is None:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"{g.name!r} has no rule for gradients: set one with an update",
                )
            if current.version >= MAX_VERSION:
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED, f"{g.name!r} has reached the largest version"
                )
            if g.data is None or g.encoding:
                raise RequestError(ErrorCode.BAD_REQUEST, f"gradient {g.name!r} has no raw data")
            if g.dtype is None:
                raise RequestError(ErrorCode.SHAPE_MISMATCH, f"gradient {g.name!r} has no dtype")
            weights = current.array
            if weights is None:
                weights = from_parameter(current)
                _set_entry_array(current, weights)  # (a cache, not a change: see Entry)
            grad = _like(g, weights) if _fits(g, current.dtype, weights) else from_parameter(g)
            if grad.dtype.kind not in "iuf" and not is_bfloat16(grad.dtype):
                raise RequestError(
                    ErrorCode.SHAPE_MISMATCH,
                    f"gradient {g.name!r} of {dtype_name(grad.dtype)} is not a real number type",
                )
            if grad.shape != weights.shape:
                raise RequestError(
                    ErrorCode.SHAPE_MISMATCH,
                    f"gradient {g.name!r} has shape {grad.shape}; the parameter has "
                    f"{weights.shape}",
                )
            if grad.dtype is not weights.dtype:
                check_cast(g.name, grad.dtype, weights.dtype, lossy=getattr(g, "lossy", False))
            if finite:
                rules.check_finite(f"gradient {g.name!r}", grad, current.rule)
            work.append((current, weights, grad))
        return work

    def state(self, name: str) -> rules.State | None:
        """What the rule of ``name`` keeps between steps, or None."""
        return self._states.get(name)

    def merge(self, params: Sequence[Any], timestamp: int) -> Applied:
        """Apply a replicated update: last writer wins on ``(version, origin)``.

        Each parameter keeps the version and origin it was given where it was
        first applied, and replaces the stored one only if its
        ``(version, origin)`` is larger; so every node that sees the same
        updates, in any order and any number of times, ends with the same
        entries. Answers the entries that won (maybe none).

        Raises:
            RequestError: a parameter is malformed (nothing is applied).
        """
        self.check(params, replicated=True)
        entries = self._entries
        # (a message may hold both keys of a parameter: the newer of them is merged)
        given = {p.name: p for p in params} if any("\x00" in p.name for p in params) else {}
        made = []
        replaced = []
        for p in params:
            current = entries.get(p.name)
            if current is not None and lww_key(current) >= lww_key(p):
                continue
            name = p.name
            partner = manifest_key(name) if given and "\x00" not in name else self.partner(name)
            if partner is not None:
                others = [o for o in (given.get(partner), entries.get(partner)) if o is not None]
                if any(_stands(other, p) for other in others):
                    continue  # (the parameter's other key is newer: see the module)
                if partner in entries:
                    replaced.append(partner)
            shape = tuple(p.shape) if p.shape is not None else None
            made.append(Entry(p.name, kept(p.data), p.version, p.dtype, shape, p.origin, p.rule))
        return self._store(made, timestamp, replaced)

    def drop(self, held: Mapping[str, tuple[int, str]]) -> list[str]:
        """Forget parameters handed to other nodes: each name whose ``lww_key`` is
        at most the one given (a newer version, written since, is kept).
        Answers the names dropped."""
        entries = self._entries
        dropped = []
        for name, key in held.items():
            entry = entries.get(name)
            if entry is not None and lww_key(entry) <= key:
                self._remove(name)
                dropped.append(name)
        return dropped

    def _remove(self, name: str) -> None:
        entry = self._entries.pop(name)
        self._nbytes -= entry.nbytes
        self._states.pop(name, None)
        if "\x00" in name and _manifest_of(name) is not None:
            self._manifests -= 1

    def _store(self, made: list[Entry], timestamp: int, replaced: Sequence[str] = ()) -> Applied:
        # Nothing here can fail: the update is applied whole. ``replaced``: the
        # other keys of parameters in ``made``, which they replace (see the module).
        entries = self._entries
        for key in replaced:
            if key in entries:
                self._remove(key)
        for entry in made:
            old = entries.get(entry.name)
            if old is not None:
                self._nbytes -= old.nbytes
                if (old.rule, old.dtype, old.shape) != (entry.rule, entry.dtype, entry.shape):
                    self._states.pop(entry.name, None)  # a new rule or layout starts over
            elif "\x00" in entry.name and _manifest_of(entry.name) is not None:
                self._manifests += 1
            entries[entry.name] = entry
            self._nbytes += entry.nbytes
        if timestamp > self.timestamp:
            self.timestamp = timestamp
        return Applied(tuple(made), self.timestamp)
