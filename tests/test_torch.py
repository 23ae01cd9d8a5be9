"""aioparamsync.torch against a real node: tensors, state dicts, in-place loads, gradients."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aioparamsync import Node, ParameterClient, thrift  # noqa: E402
from aioparamsync import torch as ps_torch  # noqa: E402
from aioparamsync.values import compression, rules  # noqa: E402


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and -0.0 included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and ps_torch.to_numpy(a).tobytes() == ps_torch.to_numpy(b).tobytes()
    )


def _special(dtype: torch.dtype) -> torch.Tensor:
    """Values that catch any conversion: extremes, subnormals, -0.0, inf, NaN."""
    if dtype == torch.bool:
        return torch.tensor([[True, False, True], [False, False, True]])
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        values = [0.0, -0.0, 1.0, -2.5, info.max, info.min, info.tiny, info.smallest_normal / 4]
        values += [float("inf"), float("-inf"), float("nan"), 1 / 3]
        return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(3, 4)
    info_i = torch.iinfo(dtype)
    return torch.tensor([[info_i.min, -1, 0], [1, 2**40, info_i.max]], dtype=dtype)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def _trained_net(seed: int) -> Net:
    """A Net whose every entry (running stats, num_batches_tracked) is off its default."""
    torch.manual_seed(seed)
    net = Net().train()
    for _ in range(3):
        net(torch.randn(8, 4))
    return net


# -- import -------------------------------------------------------------------------------


def test_importing_aioparamsync_does_not_import_torch() -> None:
    code = "import aioparamsync, sys; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_module_is_ours_and_torch_is_pytorch() -> None:
    import aioparamsync.torch

    assert aioparamsync.torch is ps_torch and ps_torch.torch is torch
    assert hasattr(ps_torch.torch, "nn")


# -- tensors <-> arrays ---------------------------------------------------------------------


def test_to_numpy_shares_memory_of_cpu_contiguous_tensors() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).requires_grad_()
    arr = ps_torch.to_numpy(t)
    assert arr.ctypes.data == t.data_ptr() and arr.shape == (3, 4) and arr.dtype == np.float32
    b = torch.zeros(5, dtype=torch.bfloat16)
    assert ps_torch.to_numpy(b).ctypes.data == b.data_ptr()


def test_to_numpy_copies_what_it_must_and_keeps_values() -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    arr = ps_torch.to_numpy(t.t())  # not contiguous
    assert arr.flags.c_contiguous
    np.testing.assert_array_equal(arr, np.arange(12).reshape(3, 4).T)
    z = torch.tensor([1 + 2j], dtype=torch.complex64).conj()  # a lazy conjugate
    np.testing.assert_array_equal(ps_torch.to_numpy(z), [1 - 2j])
    sparse = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse()
    np.testing.assert_array_equal(ps_torch.to_numpy(sparse), [[0, 2], [3, 0]])
    with pytest.raises(TypeError, match="not list"):
        ps_torch.to_numpy([1, 2])
    with pytest.raises(TypeError, match="float8"):
        ps_torch.to_numpy(torch.zeros(2, dtype=torch.float8_e4m3fn))


def test_bfloat16_converts_bit_for_bit() -> None:
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)  # all of them
    t = bits.view(torch.bfloat16)
    arr = ps_torch.to_numpy(t)
    assert arr.dtype == ml_dtypes.bfloat16
    assert arr.view(np.int16).tobytes() == bits.numpy().tobytes()
    back = ps_torch.from_numpy(arr)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), bits)
    assert ps_torch.from_numpy(np.float32(1.5).astype(ml_dtypes.bfloat16)).item() == 1.5


def test_from_numpy_shares_writable_arrays_and_copies_read_only_ones() -> None:
    arr = np.arange(6, dtype=np.float64).reshape(2, 3)
    assert ps_torch.from_numpy(arr).data_ptr() == arr.ctypes.data
    arr.flags.writeable = False
    t = ps_torch.from_numpy(arr)  # no warning (warnings fail the tests)
    assert t.data_ptr() != arr.ctypes.data and t.tolist() == arr.tolist()
    swapped = ps_torch.from_numpy(np.arange(3, dtype=">i4"))
    assert swapped.dtype == torch.int32 and swapped.tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="no tensors of dtype"):
        ps_torch.from_numpy(np.zeros(2, np.longdouble))


# -- through a node -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.float64, torch.bool],
    ids=str,
)
async def test_tensors_round_trip_exactly_through_a_node(
    client: ParameterClient, dtype: torch.dtype
) -> None:
    t = _special(dtype)
    state = {"t": t, "scalar": t.reshape(-1)[2].clone(), "empty": t[:0], "strided": t.t()}
    versions = await ps_torch.push_state_dict(client, state, prefix="x/")
    assert versions == {"t": 1, "scalar": 1, "empty": 1, "strided": 1}
    assert set((await client.get_arrays(["x/t", "t"])).keys()) == {"x/t"}
    pulled = await ps_torch.pull_state_dict(client, list(state), prefix="x/")
    assert set(pulled) == set(state)
    for key, tensor in state.items():
        assert _same_bits(pulled[key], tensor), key
    if dtype == torch.bfloat16:
        assert (await client.get_parameters(["x/t"])).params[0].dtype == "bfloat16"


async def test_a_module_loads_in_place_from_the_node(client: ParameterClient) -> None:
    source, fresh = _trained_net(0), Net()
    assert source.bn.num_batches_tracked.item() == 3
    versions = await ps_torch.push_state_dict(client, source, prefix="net/")
    keys = list(source.state_dict())
    assert versions == dict.fromkeys(keys, 1)

    before = {k: (id(t), t.data_ptr()) for k, t in fresh.state_dict(keep_vars=True).items()}
    weight = fresh.fc.weight
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    assert await ps_torch.load_into(client, fresh, prefix="net/") == versions

    after = fresh.state_dict(keep_vars=True)
    assert {k: (id(t), t.data_ptr()) for k, t in after.items()} == before
    assert fresh.fc.weight is weight and optimizer.param_groups[0]["params"][0] is weight
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad and weight.is_leaf
    for key, tensor in source.state_dict().items():
        assert _same_bits(after[key].detach(), tensor), key
    assert fresh.bn.num_batches_tracked.item() == 3
    assert fresh.bn.num_batches_tracked.dtype == torch.int64

    x = torch.randn(5, 4)
    assert torch.equal(fresh.eval()(x), source.eval()(x))


async def test_pull_state_dict_takes_a_module_and_leaves_out_what_the_node_lacks(
    client: ParameterClient,
) -> None:
    net = _trained_net(1)
    await ps_torch.push_state_dict(client, {"fc.weight": net.fc.weight}, prefix="p.")
    pulled = await ps_torch.pull_state_dict(client, Net(), prefix="p.")
    assert list(pulled) == ["fc.weight"]
    assert torch.equal(pulled["fc.weight"], net.fc.weight.detach())
    pulled["fc.weight"].add_(1)  # a tensor of its own: writable
    assert await ps_torch.pull_state_dict(client, [], prefix="p.") == {}
    with pytest.raises(TypeError, match="list of state-dict keys"):
        await ps_torch.pull_state_dict(client, "fc.weight")


async def test_versions_grow_with_each_push(client: ParameterClient) -> None:
    net = _trained_net(2)
    await ps_torch.push_state_dict(client, net)
    assert set((await ps_torch.push_state_dict(client, net)).values()) == {2}
    assert set((await ps_torch.load_into(client, Net())).values()) == {2}


# -- errors -------------------------------------------------------------------------------


async def test_a_shape_or_dtype_mismatch_names_the_tensor_and_changes_nothing(
    client: ParameterClient,
) -> None:
    await ps_torch.push_state_dict(client, _trained_net(3))
    await client.update_arrays({"fc.bias": np.zeros(4, np.float32)}, replace=True)  # Net's: (3,)
    fresh = Net()
    before = {k: t.clone() for k, t in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"'fc\.bias'.*\(4,\).*\(3,\)"):
        await ps_torch.load_into(client, fresh)
    assert all(torch.equal(t, before[k]) for k, t in fresh.state_dict().items())

    await client.update_arrays({"fc.bias": np.zeros(3, np.float64)}, replace=True)
    with pytest.raises(ValueError, match=r"'fc\.bias'.*torch\.float64.*torch\.float32"):
        await ps_torch.load_into(client, fresh)
    assert all(torch.equal(t, before[k]) for k, t in fresh.state_dict().items())


@pytest.mark.parametrize("name", ["f", "freqs", "a_longer_buffer_name"])
async def test_a_buffer_received_out_of_alignment_loads(client: ParameterClient, name) -> None:
    # A received array is a view of the message, wherever its name's length puts
    # it: a complex128 one is often not aligned to 16 bytes (torch crashed on it).
    freqs = torch.polar(torch.ones(3, dtype=torch.float64), torch.arange(3.0, dtype=torch.float64))
    await ps_torch.push_state_dict(client, {name: freqs})
    target = {name: torch.zeros(3, dtype=torch.complex128)}
    assert await ps_torch.load_into(client, _Holder(target)) == {name: 1}
    assert torch.equal(target[name], freqs)
    assert torch.equal(ps_torch.from_numpy((await client.get_arrays([name]))[name]), freqs)


class _Holder(torch.nn.Module):
    """A module whose buffers are the given tensors (by name)."""

    def __init__(self, tensors: dict) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.tensors = tensors

    def state_dict(self, *args, **kwargs):  # the given tensors themselves
        return dict(self.tensors)


async def test_a_module_on_the_meta_device_is_refused_not_left_empty(client) -> None:
    await ps_torch.push_state_dict(client, torch.nn.Linear(3, 2))
    with torch.device("meta"):
        module = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="meta device"):
        await ps_torch.load_into(client, module)


async def test_missing_names_raise_when_strict_and_are_skipped_when_not(
    client: ParameterClient,
) -> None:
    source = _trained_net(4)
    await ps_torch.push_state_dict(
        client, {k: v for k, v in source.state_dict().items() if not k.startswith("bn.")}
    )
    fresh = Net()
    bn_before = {k: v.clone() for k, v in fresh.bn.state_dict().items()}
    with pytest.raises(KeyError) as info:
        await ps_torch.load_into(client, fresh)
    for name in ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"):
        assert name in str(info.value)
    assert "bn.num_batches_tracked" in str(info.value) and "fc.weight" not in str(info.value)
    assert not torch.equal(fresh.fc.weight, source.fc.weight)  # nothing was loaded

    versions = await ps_torch.load_into(client, fresh, strict=False)
    assert versions == {"fc.weight": 1, "fc.bias": 1}
    assert torch.equal(fresh.fc.weight, source.fc.weight)
    assert all(torch.equal(v, bn_before[k]) for k, v in fresh.bn.state_dict().items())


async def test_entries_that_are_not_tensors_are_refused(client: ParameterClient) -> None:
    with pytest.raises(TypeError, match=r"'lr' \(float\).*'w' \(ndarray\)"):
        await ps_torch.push_state_dict(client, {"lr": 0.1, "w": np.zeros(2), "b": torch.ones(2)})
    with pytest.raises(TypeError, match=r"nn\.Module or a state dict"):
        await ps_torch.push_state_dict(client, [torch.ones(2)])
    with pytest.raises(TypeError, match=r"nn\.Module"):
        await ps_torch.load_into(client, {"w": torch.ones(2)})
    with pytest.raises(TypeError, match=r"nn\.Module"):
        await ps_torch.push_grads(client, {"w": torch.ones(2)})
    assert await client.get_arrays(["lr", "w", "b"]) == {}  # nothing was sent
    assert await ps_torch.push_state_dict(client, {}) == {}


# -- rules and gradients ------------------------------------------------------------------


async def test_a_rule_is_set_on_a_modules_parameters_not_its_buffers(
    client: ParameterClient,
) -> None:
    calls: list[dict] = []
    update_arrays = client.update_arrays

    async def spy(arrays, **kwargs):
        calls.append(kwargs.get("rules"))
        return await update_arrays(arrays, **kwargs)

    client.update_arrays = spy
    sgd = rules.sgd(lr=0.1)
    await ps_torch.push_state_dict(client, _trained_net(5), prefix="r/", rule=sgd)
    assert calls[-1] == dict.fromkeys(["r/fc.weight", "r/fc.bias", "r/bn.weight", "r/bn.bias"], sgd)
    state = {"w": torch.ones(2), "steps": torch.tensor(3), "z": torch.ones(1, dtype=torch.cfloat)}
    await ps_torch.push_state_dict(client, state, rule=sgd)
    assert calls[-1] == {"w": sgd}  # a state dict: its floating-point tensors (not complex)
    await ps_torch.push_state_dict(client, state, prefix="m/", rule={"w": sgd})
    assert calls[-1] == {"m/w": sgd}
    with pytest.raises(KeyError, match="nope"):
        await ps_torch.push_state_dict(client, state, rule={"nope": sgd})


async def test_push_grads_takes_an_sgd_step_on_the_node(client: ParameterClient) -> None:
    lr = 0.5
    net = _trained_net(6)
    await ps_torch.push_state_dict(client, net, prefix="g/", rule=thrift.Rule(kind="sgd", lr=lr))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net.zero_grad(set_to_none=True)
    net.bn.bias.requires_grad_(False)  # no gradient: not sent
    net(torch.randn(8, 4)).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    assert set(grads) == {"fc.weight", "fc.bias", "bn.weight"}

    versions = await ps_torch.push_grads(client, net, prefix="g/", request_id="step-1")
    assert versions == dict.fromkeys(grads, 2)
    pulled = await ps_torch.pull_state_dict(client, net, prefix="g/")
    for name, grad in grads.items():
        assert torch.equal(pulled[name], before[name] - lr * grad), name
    for name in ("bn.bias", "bn.running_mean", "bn.num_batches_tracked"):
        assert torch.equal(pulled[name], before[name]), name

    # The same request_id again (a retry): applied once.
    assert await ps_torch.push_grads(client, net, prefix="g/", request_id="step-1") == versions


async def _train_mlp(
    client: ParameterClient, prefix: str, rule: object, **push: object
) -> tuple[float, float, float]:
    """An MLP trained through the node by ``rule``: the first and last loss, and the
    mean share of the first layer's weight that the pushes sent."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(256, 8)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    await ps_torch.push_state_dict(client, model, prefix=prefix, rule=rule)
    losses, shares = [], []
    for _ in range(150):
        await ps_torch.load_into(client, model, prefix=prefix)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        await ps_torch.push_grads(client, model, prefix=prefix, **push)
        sent = client.stats()["gradients"].get(f"{prefix}0.weight")
        shares.append(1.0 if sent is None else sent["share"])
    return losses[0], losses[-1], sum(shares) / len(shares)


@pytest.mark.parametrize(
    "rule", [rules.sgd(0.5), rules.sgd(0.1, momentum=0.9)], ids=["sgd", "momentum 0.9"]
)
async def test_a_model_trained_with_compressed_gradients_converges_like_one_trained_raw(
    client: ParameterClient, rule: object
) -> None:
    # 1% with momentum 0.9: the case a fixed top-k ratio diverged in (values/feedback.py).
    first, raw, _ = await _train_mlp(client, "raw/", rule)
    assert raw < 0.05 * first, (first, raw)  # not vacuous: the raw run learns
    for encoding, ratio in (("topk", 0.01), ("topk", 0.25), ("int8", None)):
        prefix = f"{encoding}{ratio}/"
        _, last, share = await _train_mlp(client, prefix, rule, encoding=encoding, ratio=ratio)
        assert last < 0.05 * first and last < 2 * raw + 1e-3, (encoding, ratio, first, raw, last)
        if encoding == "topk" and rule.momentum == 0:
            assert share < 0.9, (ratio, share)  # top-k left values out, often


async def test_push_grads_steps_every_key_of_a_tied_weight_and_passes_the_encoding_on(
    client: ParameterClient,
) -> None:
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    net[1].weight = net[0].weight  # one Parameter under two keys
    rule = thrift.Rule(kind="sum")  # w += g
    await ps_torch.push_state_dict(client, net, rule=rule)
    w = net[0].weight.detach().clone()
    net(torch.randn(4, 3)).sum().backward()
    grad = net[0].weight.grad.clone()
    versions = await ps_torch.push_grads(client, net, encoding="zlib")  # lossless
    assert versions == {"0.weight": 2, "1.weight": 2}
    assert await ps_torch.load_into(client, net) == versions
    assert torch.equal(net[0].weight.detach(), w + grad) and net[1].weight is net[0].weight


class Branches(torch.nn.Module):
    """Two heads; a step that uses one leaves the other's gradients None."""

    def __init__(self) -> None:
        super().__init__()
        self.left = torch.nn.Linear(3, 2)
        self.right = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, head: str = "left") -> torch.Tensor:
        return getattr(self, head)(x)


def _requests(node: Node) -> int:
    """Calls the node has received (every method)."""
    return node.server.counters["requests"]


def _stored(node: Node) -> dict[str, tuple[int, bytes]]:
    """name -> (version, bytes) of everything the node holds."""
    return {
        name: (entry.version, bytes(entry.data))
        for name in node.table.names()
        if (entry := node.table.entry(name)) is not None
    }


async def test_push_grads_before_backward_is_an_error_and_sends_nothing(
    node: Node, client: ParameterClient
) -> None:
    torch.manual_seed(8)
    net = Branches()
    await ps_torch.push_state_dict(client, net, prefix="b/", rule=rules.sgd(lr=0.1))
    before, calls = _stored(node), _requests(node)
    with pytest.raises(ValueError, match=r"every \.grad is None.*loss\.backward\(\)"):
        await ps_torch.push_grads(client, net, prefix="b/")
    assert _requests(node) == calls and _stored(node) == before  # nothing was sent

    net.requires_grad_(False)  # frozen whole: nothing it could ever push
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        await ps_torch.push_grads(client, net, prefix="b/")
    with pytest.raises(ValueError, match="ReLU has no parameter"):
        await ps_torch.push_grads(client, torch.nn.ReLU())
    assert _requests(node) == calls and _stored(node) == before


async def test_push_grads_sends_what_this_step_used_and_skips_frozen_parameters(
    node: Node, client: ParameterClient
) -> None:
    torch.manual_seed(9)
    net = Branches()
    await ps_torch.push_state_dict(client, net, rule=rules.sgd(lr=0.1))
    net(torch.randn(4, 3), head="right").sum().backward()  # left: .grad stays None
    net.right.bias.requires_grad_(False)  # frozen after backward: its .grad is stale
    assert net.right.bias.grad is not None and net.left.weight.grad is None
    before = _stored(node)
    assert await ps_torch.push_grads(client, net) == {"right.weight": 2}
    after = _stored(node)
    assert after["right.weight"][0] == 2
    assert {k: v for k, v in after.items() if k != "right.weight"} == {
        k: v for k, v in before.items() if k != "right.weight"
    }


async def test_two_models_with_the_same_keys_stay_apart_under_their_prefixes(
    node: Node, client: ParameterClient
) -> None:
    lr = 0.5
    encoder, decoder = _trained_net(10), _trained_net(11)
    keys = list(encoder.state_dict())
    assert list(decoder.state_dict()) == keys  # the same names: weight, bias, ...
    for prefix, net in (("encoder.", encoder), ("decoder.", decoder)):
        versions = await ps_torch.push_state_dict(client, net, prefix=prefix, rule=rules.sgd(lr))
        assert versions == dict.fromkeys(keys, 1)  # its own parameters: each a first version
    assert sorted(node.table.names()) == sorted(
        [f"encoder.{k}" for k in keys] + [f"decoder.{k}" for k in keys]
    )

    loaded = {"encoder.": Net(), "decoder.": Net()}
    for prefix, fresh in loaded.items():
        assert await ps_torch.load_into(client, fresh, prefix=prefix) == dict.fromkeys(keys, 1)
    for source, fresh in ((encoder, loaded["encoder."]), (decoder, loaded["decoder."])):
        for key, tensor in source.state_dict().items():
            assert _same_bits(fresh.state_dict()[key], tensor), key

    # A step of the encoder moves the encoder's parameters only, and then the decoder's its own.
    for prefix, net, other in (
        ("encoder.", encoder, "decoder."),
        ("decoder.", decoder, "encoder."),
    ):
        net.zero_grad(set_to_none=True)
        net(torch.randn(8, 4)).pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        values = {k: t.clone() for k, t in net.state_dict().items()}
        untouched = {n: v for n, v in _stored(node).items() if n.startswith(other)}
        versions = await ps_torch.push_grads(client, net, prefix=prefix)
        assert versions == dict.fromkeys(grads, 2)
        pulled = await ps_torch.pull_state_dict(client, keys, prefix=prefix)
        for name, grad in grads.items():
            assert torch.equal(pulled[name], values[name] - lr * grad), (prefix, name)
        assert {n: v for n, v in _stored(node).items() if n.startswith(other)} == untouched


async def test_error_feedback_keeps_each_prefixed_models_residuals_apart(
    node: Node, client: ParameterClient
) -> None:
    # w += g: what is stored is what was sent, so a residual carried from the
    # other model's push would show.
    torch.manual_seed(12)
    models = {"a/": torch.nn.Linear(16, 8, bias=False), "b/": torch.nn.Linear(16, 8, bias=False)}
    for prefix, model in models.items():
        await ps_torch.push_state_dict(client, model, prefix=prefix, rule=rules.sum_rule())
    for prefix, model in models.items():
        w = model.weight.detach().clone()
        model(torch.randn(4, 16)).pow(3).sum().backward()
        grad = ps_torch.to_numpy(model.weight.grad)
        sent = compression.decode(compression.encode("weight", grad, "int8"))
        assert not np.array_equal(sent, grad)  # int8 left a residual
        await ps_torch.push_grads(client, model, prefix=prefix, encoding="int8")
        stored = (await ps_torch.pull_state_dict(client, ["weight"], prefix=prefix))["weight"]
        assert torch.equal(stored, w + torch.from_numpy(sent)), prefix


@pytest.mark.parametrize("prefix", [None, b"encoder.", 3, ["encoder."]], ids=repr)
async def test_a_prefix_that_is_not_a_str_is_refused_by_every_helper_before_sending(
    node: Node, client: ParameterClient, prefix
) -> None:
    net = _trained_net(13)
    net(torch.randn(8, 4)).sum().backward()
    calls = _requests(node)
    message = r"prefix must be a str .*'encoder\.'.*, not " + type(prefix).__name__
    with pytest.raises(TypeError, match=message):
        await ps_torch.push_state_dict(client, net, prefix=prefix, rule=rules.sgd(0.1))
    with pytest.raises(TypeError, match=message):
        await ps_torch.push_state_dict(client, {}, prefix=prefix)
    with pytest.raises(TypeError, match=message):
        await ps_torch.pull_state_dict(client, net, prefix=prefix)
    with pytest.raises(TypeError, match=message):
        await ps_torch.load_into(client, net, prefix=prefix)
    with pytest.raises(TypeError, match=message):
        await ps_torch.push_grads(client, net, prefix=prefix)
    assert _requests(node) == calls and node.table.names() == []
