"""torch tensors and modules <-> a node: state dicts, gradients, in-place loads.

Import it yourself (``from aioparamsync import torch as ps_torch``);
``import aioparamsync`` never imports torch. Needs ``pip install '.[torch]'``
(in the checkout).

Every function here speaks in state-dict keys (``"0.weight"``,
``"bn.running_mean"``); on the node each key is stored as ``prefix + key``
(every function takes the same ``prefix=``, a str, ``""`` by default), so one
node can hold several models whose keys are the same: ``prefix="encoder."``
stores ``encoder.0.weight``, ``prefix="decoder."`` ``decoder.0.weight``. The
prefix is put as it is, separator included. Answers are keyed by state-dict
key, without the prefix.

Tensors travel as numpy arrays (:func:`to_numpy`, :func:`from_numpy`): a CPU
tensor in C order is sent without a copy, and a dtype and shape go with it,
so every dtype numpy knows (bool, ints, float16/32/64, complex) comes back
exactly. ``torch.bfloat16`` travels as ml_dtypes' ``bfloat16`` (the same
16 bits, dtype ``"bfloat16"`` on the wire).

Sizes: a push or a pull is one call, so one state dict must fit in the
client's and the node's largest frame (``max_frame_bytes``, 256 MiB by
default). That is what makes a push atomic and a pull one consistent
snapshot.

Workers launched by torchrun (``torchrun --nproc-per-node N train.py``) or a
PyTorchJob: :class:`Launch` (``Launch.from_env()``) reads their rank and world
size, and the nodes' addresses, from the environment those set (see
:mod:`aioparamsync.client.launch`; ``examples/torchrun_train.py``).

Each function that takes a client is a coroutine function of a
:class:`~aioparamsync.ParameterClient` (``await ps_torch.push_grads(client,
model)``), and takes a :class:`~aioparamsync.SyncParameterClient` too: then it
blocks and answers the result (``ps_torch.push_grads(client, model)``), run
on that client's loop.

Embedding tables held by the cluster (``ParameterClient.create_table``):
:class:`Embedding` and :class:`EmbeddingBag` are modules that pull a batch's
rows, gather from them in forward and push their gradients (see
:mod:`aioparamsync.torch_rows`; ``examples/train_ctr.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]  # PyTorch (imports are absolute)

from .client.blocking import also_blocking
from .client.launch import Launch
from .torch_rows import Embedding, EmbeddingBag
from .values.arrays import from_parameter, is_bfloat16

if TYPE_CHECKING:
    from .client.api import ParameterClient

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "Launch",
    "from_numpy",
    "load_into",
    "pull_state_dict",
    "push_grads",
    "push_state_dict",
    "to_numpy",
]

Timeout = float | EllipsisType | None


# -- tensors <-> arrays ----------------------------------------------------------------


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The values of a tensor as a numpy array, to send.

    The tensor is detached and brought to the CPU in C order; a CPU tensor
    in C order is not copied (the array shares its memory: do not change the
    tensor until the call that sends the array has returned). A sparse tensor
    is made dense. ``torch.bfloat16`` becomes an ``ml_dtypes.bfloat16`` array
    of the same bits.

    Args:
        tensor: any tensor (on any device, requiring grad or not).

    Returns:
        A numpy array with the tensor's shape and values.

    Raises:
        TypeError: not a tensor, or a dtype numpy cannot hold (float8...).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, not {type(tensor).__name__}")
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type != "cpu":
        t = t.cpu()
    # A lazily conjugated or negated view: numpy cannot see the bit.
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    try:
        return t.numpy()
    except TypeError:
        raise TypeError(f"cannot send a tensor of dtype {t.dtype}: numpy has none") from None


def from_numpy(array: Any) -> torch.Tensor:
    """A CPU tensor of a numpy array (an ``ml_dtypes.bfloat16`` one gives ``torch.bfloat16``).

    The tensor shares the array's memory when the array is writable, in C
    order and in native byte order; otherwise (e.g. the read-only arrays a
    node answers) it is a copy, since a tensor may be written to.

    Args:
        array: a numpy array (or anything ``np.asarray`` takes).

    Returns:
        A tensor with the array's dtype, shape and values.

    Raises:
        TypeError: a dtype torch has no tensors of (longdouble, strings...).
    """
    arr = np.asarray(array)
    flags = arr.flags
    if not (flags.writeable and flags.c_contiguous and _aligned(arr) and arr.dtype.isnative):
        arr = _native_copy(arr)
    return _tensor(arr)


def _aligned(arr: np.ndarray) -> bool:
    """Whether ``arr`` starts at a multiple of its item size (up to 16 bytes).

    Stricter than numpy's ``aligned`` flag, which asks a complex128 array for 8
    bytes only: torch's copy of a complex128 tensor at an odd multiple of 8
    crashes the process. A received array is a view of its message, wherever
    the message puts it.
    """
    return arr.ctypes.data % min(arr.dtype.itemsize, 16) == 0


def _native_copy(arr: np.ndarray) -> np.ndarray:
    """A C-ordered copy of ``arr`` in the host's byte order (what torch.from_numpy takes)."""
    return np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C", copy=True)


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy``, bfloat16 included (``arr`` is C-ordered and native)."""
    if is_bfloat16(arr.dtype):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_numpy(arr)
    except TypeError:
        raise TypeError(f"torch has no tensors of dtype {arr.dtype}") from None


def _source_tensor(arr: np.ndarray) -> torch.Tensor:
    """A tensor over ``arr`` (read-only or not) that is only ever read from: no copy.

    But for a copy where torch needs one: an array in another byte order or
    layout, or one not aligned to its items (see :func:`_aligned`).
    """
    if not (arr.flags.c_contiguous and _aligned(arr) and arr.dtype.isnative):
        arr = _native_copy(arr)
    if arr.flags.writeable:
        return _tensor(arr)
    with warnings.catch_warnings():
        # torch warns that writing to it would be undefined: it is only read.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return _tensor(arr)


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("sending torch.bfloat16 needs ml_dtypes (pip install ml_dtypes)") from None
    return ml_dtypes.bfloat16


# -- state dicts --------------------------------------------------------------------------


def _state_dict(module_or_state_dict: Any) -> Mapping[str, Any]:
    if isinstance(module_or_state_dict, torch.nn.Module):
        return module_or_state_dict.state_dict()
    if isinstance(module_or_state_dict, Mapping):
        return module_or_state_dict
    raise TypeError(
        "expected a torch.nn.Module or a state dict (a mapping of name -> tensor), not "
        f"{type(module_or_state_dict).__name__}"
    )


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict's entries, each checked to be a tensor."""
    wrong = {k: type(v).__name__ for k, v in state.items() if not isinstance(v, torch.Tensor)}
    if wrong:
        listed = ", ".join(f"{k!r} ({t})" for k, t in wrong.items())
        raise TypeError(f"state dict entries that are not tensors: {listed}")
    return dict(state)


def _check_prefix(prefix: Any) -> str:
    """``prefix`` itself, checked to be a str (before anything is sent)."""
    if not isinstance(prefix, str):
        raise TypeError(
            f"prefix must be a str put before each state-dict key (e.g. 'encoder.'), "
            f"not {type(prefix).__name__}"
        )
    return prefix


def _unprefixed(versions: Mapping[str, int], prefix: str) -> dict[str, int]:
    return {
        (name[len(prefix) :] if name.startswith(prefix) else name): int(version)
        for name, version in versions.items()
    }


def _rules(
    rule: Any, module_or_state_dict: Any, tensors: Mapping[str, torch.Tensor], prefix: str
) -> dict[str, Any]:
    """The rule of each pushed name (prefixed), from ``push_state_dict``'s ``rule``."""
    if isinstance(rule, Mapping):
        unknown = sorted(set(rule) - set(tensors))
        if unknown:
            raise KeyError(f"rules for names not in the state dict: {', '.join(unknown)}")
        return {prefix + key: r for key, r in rule.items()}
    keys = [k for k, t in tensors.items() if t.is_floating_point()]  # what a node's rules fit
    if isinstance(module_or_state_dict, torch.nn.Module):
        # Its parameters, aliases of a shared one included; not its buffers.
        trained = {n for n, _ in module_or_state_dict.named_parameters(remove_duplicate=False)}
        keys = [k for k in keys if k in trained]
    return {prefix + key: rule for key in keys}


@also_blocking
async def push_state_dict(
    client: ParameterClient,
    module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
    rule: Any = None,
    timeout: Timeout = ...,
) -> dict[str, int]:
    """Store every tensor of a state dict on the node, in one atomic update.

    Every parameter and buffer is sent (a module's ``state_dict()``), CPU
    tensors in C order without a copy: do not change them until this returns.

    Args:
        client: the client to send with (a SyncParameterClient: this blocks).
        module_or_state_dict: a module, or a mapping of key -> tensor.
        prefix: put before each key to make the node's name (``"encoder."``
            stores ``encoder.weight``), so that models with the same keys do
            not overwrite each other.
        rule: the gradient rule (the IDL's ``Rule``, e.g.
            ``aioparamsync.values.rules.sgd(lr=0.1)``) that :func:`push_grads`
            folds gradients in by. One rule is set on a module's
            floating-point parameters (not its buffers), or on every
            floating-point tensor of a state dict; a mapping of key ->
            ``Rule`` sets exactly those. None keeps each stored parameter's
            rule.
        timeout: the call's deadline (seconds; default: the client's).

    Returns:
        The version each key now has on the node.

    Raises:
        TypeError: an entry is not a tensor, or has a dtype numpy cannot
            hold; ``prefix`` is not a str.
        KeyError: ``rule`` names a key the state dict does not have.
        RequestError: the node refused the update (nothing was stored).
        CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
    """
    prefix = _check_prefix(prefix)
    tensors = _tensors(_state_dict(module_or_state_dict))
    if not tensors:
        return {}
    arrays = {prefix + key: to_numpy(t) for key, t in tensors.items()}
    rules = None if rule is None else _rules(rule, module_or_state_dict, tensors, prefix)
    versions = await client.update_arrays(arrays, rules=rules, timeout=timeout)
    return _unprefixed(versions, prefix)


def _keys(names_or_module: Any) -> list[str]:
    if isinstance(names_or_module, torch.nn.Module):
        return list(names_or_module.state_dict())
    if isinstance(names_or_module, (str, bytes)) or not isinstance(names_or_module, Iterable):
        raise TypeError("expected a torch.nn.Module or a list of state-dict keys")
    keys = list(names_or_module)
    if not all(isinstance(k, str) for k in keys):
        raise TypeError("state-dict keys must be strings")
    return keys


async def _pull(
    client: ParameterClient, keys: list[str], prefix: str, timeout: Timeout
) -> dict[str, tuple[np.ndarray, int]]:
    """key -> (read-only array, version) of each key the node holds."""
    if not keys:
        return {}
    response = await client.get_parameters([prefix + k for k in keys], timeout=timeout)
    wanted = set(keys)
    pulled: dict[str, tuple[np.ndarray, int]] = {}
    for p in response.params:
        key = p.name[len(prefix) :]
        if p.name.startswith(prefix) and key in wanted:
            pulled[key] = (from_parameter(p), int(p.version))
    return pulled


@also_blocking
async def pull_state_dict(
    client: ParameterClient,
    names_or_module: torch.nn.Module | Iterable[str],
    *,
    prefix: str = "",
    timeout: Timeout = ...,
) -> dict[str, torch.Tensor]:
    """Fetch tensors from the node, all from one consistent snapshot.

    Keys the node does not hold are left out (as ``get_arrays`` does); check
    the answer, or use :func:`load_into`, when every key must be there.

    Args:
        client: the client to fetch with (a SyncParameterClient: this blocks).
        names_or_module: state-dict keys, or a module (the keys of its
            ``state_dict()``).
        prefix: put before each key to make the node's name: the one the
            tensors were pushed with.
        timeout: the call's deadline (seconds; default: the client's).

    Returns:
        key -> a new CPU tensor with the stored dtype, shape and values (one
        copy of the received bytes, which are read-only).

    Raises:
        TypeError: neither a module nor a list of keys; a stored dtype torch
            has no tensors of; ``prefix`` is not a str.
        RequestError: the node refused the request (e.g. too many names).
        CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
    """
    prefix = _check_prefix(prefix)
    pulled = await _pull(client, _keys(names_or_module), prefix, timeout)
    return {key: from_numpy(arr) for key, (arr, _) in pulled.items()}


@also_blocking
async def load_into(
    client: ParameterClient,
    module: torch.nn.Module,
    *,
    prefix: str = "",
    strict: bool = True,
    timeout: Timeout = ...,
) -> dict[str, int]:
    """Fetch every parameter and buffer of a module and copy them into it, in place.

    The module's own tensors take the values (``copy_`` under
    ``torch.no_grad()``): the same tensor objects, the same memory, on their
    own devices, so an optimizer that holds them and views of them see the
    new values. Everything is checked before anything is copied: an error
    leaves the module as it was.

    Args:
        client: the client to fetch with (a SyncParameterClient: this blocks).
        module: the module to load (every entry of its ``state_dict()``).
        prefix: put before each key to make the node's name: the one the
            module was pushed with.
        strict: raise if the node lacks a key; else leave that tensor as it is.
        timeout: the call's deadline (seconds; default: the client's).

    Returns:
        The version of each key loaded.

    Raises:
        KeyError: ``strict`` and the node lacks keys (all are listed).
        ValueError: a stored tensor's dtype or shape differs from the module's.
        TypeError: not a module, or its state dict has an entry that is not
            a tensor; ``prefix`` is not a str.
        RequestError: the node refused the request (e.g. too many names).
        CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
    """
    prefix = _check_prefix(prefix)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, not {type(module).__name__}")
    # keep_vars: the Parameter objects themselves, not detached aliases.
    targets = _tensors(module.state_dict(keep_vars=True))
    pulled = await _pull(client, list(targets), prefix, timeout)
    missing = [key for key in targets if key not in pulled]
    if missing and strict:
        raise KeyError(f"the node has no {', '.join(prefix + k for k in missing)}")
    sources: dict[str, torch.Tensor] = {}
    for key, (arr, _) in pulled.items():
        source, target = _source_tensor(arr), targets[key]
        if target.is_meta:  # (copy_ into it does nothing, and says nothing)
            raise ValueError(
                f"{key!r} is on the meta device: it has no memory to load into "
                "(materialize the module first, e.g. module.to_empty(device='cpu'))"
            )
        if source.dtype != target.dtype or source.shape != target.shape:
            raise ValueError(
                f"{key!r}: the node holds {source.dtype} {tuple(source.shape)}, "
                f"the module has {target.dtype} {tuple(target.shape)}"
            )
        sources[key] = source
    with torch.no_grad():
        for key, source in sources.items():
            targets[key].copy_(source)
    return {key: version for key, (_, version) in pulled.items()}


# -- gradients ----------------------------------------------------------------------------


@also_blocking
async def push_grads(
    client: ParameterClient,
    module: torch.nn.Module,
    *,
    prefix: str = "",
    encoding: str | None = None,
    ratio: float = 0.01,
    error_feedback: bool = True,
    max_residual: float | None = None,
    warmup: int = 0,
    request_id: str | None = None,
    timeout: Timeout = ...,
) -> dict[str, int]:
    """Send the gradients of a module's parameters; the node folds them in by each one's rule.

    Every parameter that requires grad and whose ``.grad`` is set is sent,
    in one atomic ``push_gradients`` call. A parameter whose ``.grad`` is
    None (one this step's loss did not use) is left out, and so is a frozen
    one (``requires_grad=False``), even with a ``.grad`` left from before it
    was frozen. A parameter shared under several keys (tied weights) is sent
    under each, so every stored copy takes the same step. The parameters
    must have been stored with a rule (``push_state_dict(..., rule=...)``).

    Args:
        client: the client to send with (a SyncParameterClient: this blocks).
        module: the module whose parameters' gradients to send.
        prefix: put before each key to make the node's name: the one the
            module was pushed with. Error feedback keeps its residuals by
            that name too, so two models on one client keep theirs apart.
        encoding: how to compress the gradients on the wire (``"fp16"``,
            ``"bf16"``, ``"int8"``, ``"topk"``, ``"zlib"``; None: raw).
        ratio: for ``"topk"``, the least share of elements sent.
        error_feedback: with a lossy encoding, the client keeps what
            compression left out of each gradient and adds it to the next
            (see :meth:`ParameterClient.push_gradients`).
        max_residual, warmup: top-k's bound and sparsity warm-up, as in
            :meth:`ParameterClient.push_gradients`.
        request_id: unique per push; a push sent again with the same id (a
            retry) is applied once (default: a new id).
        timeout: the call's deadline (seconds; default: the client's).

    Returns:
        The version each key sent now has on the node.

    Raises:
        ValueError: nothing to push (no call is made): no trainable
            parameter has a gradient (call ``loss.backward()`` first), or the
            module has no trainable parameter at all.
        TypeError: not a module, a gradient of a dtype numpy cannot hold, or
            ``prefix`` is not a str.
        RequestError: the node refused the push (unknown names, no rule,
            shape mismatch...); nothing was applied.
        CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
    """
    prefix = _check_prefix(prefix)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, not {type(module).__name__}")
    trainable = [
        (name, p) for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad
    ]
    if not trainable:
        raise ValueError(
            f"push_grads: the {type(module).__name__} has no parameter that requires grad, "
            "so no gradient to push"
        )
    grads = {prefix + name: to_numpy(p.grad) for name, p in trainable if p.grad is not None}
    if not grads:
        # Partly used models leave some .grad None; all None is a missed backward().
        raise ValueError(
            f"push_grads: no parameter of the {type(module).__name__} has a gradient "
            "(every .grad is None): call loss.backward() first"
        )
    versions = await client.push_gradients(
        grads,
        encoding=encoding,
        ratio=ratio,
        error_feedback=error_feedback,
        max_residual=max_residual,
        warmup=warmup,
        request_id=request_id,
        timeout=timeout,
    )
    return _unprefixed(versions, prefix)
