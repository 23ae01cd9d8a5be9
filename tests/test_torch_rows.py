"""``aioparamsync.torch.Embedding`` / ``EmbeddingBag`` against a real node.

What a model sees is what ``pull_rows`` answers; a step (pull, forward,
backward, push) leaves on the node what ``nn.Embedding(sparse=True)`` (or
``nn.EmbeddingBag``) with ``torch.optim.SGD`` / ``Adagrad`` leaves in a local
weight, duplicate ids in a batch included; misuse is refused before anything
is sent; and a model with a dense part on a local ``torch.optim.Adam`` learns.
Every call to the node goes through :class:`Recording`, a thin fake around the
real client that counts them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aioparamsync import ParameterClient, adagrad, adam, sgd  # noqa: E402
from aioparamsync import torch as ps_torch  # noqa: E402
from aioparamsync.errors import CallTimeout, RequestError  # noqa: E402

pytestmark = pytest.mark.timeout(30)

DIM = 4
# Large, scattered ids: a table is sparse, not a dense range.
BASE = 10**12


class Recording:
    """The real client, but its ``pull_rows`` / ``push_row_gradients`` calls are recorded.

    ``fail_after_push``: the next push reaches the node, then raises CallTimeout
    (as a reply lost on the way back would).
    """

    def __init__(self, client: ParameterClient) -> None:
        self.client = client
        self.pulls: list[np.ndarray] = []
        self.pushes: list[tuple[np.ndarray, np.ndarray, str | None]] = []
        self.fail_after_push = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def pull_rows(self, table: str, ids: np.ndarray, **kwargs: Any) -> np.ndarray:
        self.pulls.append(np.array(ids))
        return await self.client.pull_rows(table, ids, **kwargs)

    async def push_row_gradients(self, table: str, ids: Any, grads: Any, **kwargs: Any) -> Any:
        self.pushes.append((np.array(ids), np.array(grads), kwargs.get("request_id")))
        result = await self.client.push_row_gradients(table, ids, grads, **kwargs)
        if self.fail_after_push:
            self.fail_after_push = False
            raise CallTimeout("the reply was lost (a fake)")
        return result


@pytest.fixture
def recording(client: ParameterClient) -> Recording:
    return Recording(client)


def batches(seed: int, steps: int, n: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Local indices in [0, n), with repeats, a batch per step."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n, shape, generator=g) for _ in range(steps)]


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient depends on the rows (so the steps compound)."""
    return ((out * target).sum(-1) - 1.0).pow(2).sum()


async def test_the_rows_a_model_sees_are_pull_rows_and_a_batch_is_pulled_once(
    recording: Recording,
) -> None:
    await recording.create_table("t", DIM, init="normal", scale=0.5, seed=3)
    emb = ps_torch.Embedding(recording, "t", DIM)
    ids = torch.tensor([[BASE + 7, -5, BASE + 7], [3, -5, 2**62]])
    rows = await emb.pull(ids)
    assert len(recording.pulls) == 1
    np.testing.assert_array_equal(recording.pulls[0], [-5, 3, BASE + 7, 2**62])  # unique
    assert rows.is_leaf and rows.requires_grad and rows.shape == (4, DIM)
    assert rows.dtype == torch.float32
    out = emb(ids)
    assert out.shape == (2, 3, DIM)
    expected = await recording.client.pull_rows("t", ids.reshape(-1).numpy())
    np.testing.assert_array_equal(out.detach().numpy().reshape(-1, DIM), expected)
    # Any of the pulled ids, in any shape: one pull serves several lookups.
    np.testing.assert_array_equal(emb(torch.tensor([3])).detach().numpy()[0], expected[3])
    np.testing.assert_array_equal(emb(np.array([3])).detach().numpy()[0], expected[3])
    np.testing.assert_array_equal(emb([[3]]).detach().numpy()[0, 0], expected[3])
    assert torch.equal(emb.pulled_ids, torch.tensor([-5, 3, BASE + 7, 2**62]))
    assert "4 rows pulled, no grad" in repr(emb)


async def _train_on_node(
    recording: Recording, module: Any, steps: list[torch.Tensor], target: torch.Tensor, **kw: Any
) -> None:
    for local in steps:
        ids = local + BASE
        await module.pull(ids)
        loss_of(module(ids, **kw), target).backward()
        await module.push()


@pytest.mark.parametrize(
    ("rule", "optimizer"),
    [
        (sgd(0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
        (adagrad(0.1), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)),
    ],
    ids=["sgd", "adagrad"],
)
async def test_a_step_folds_the_rows_as_a_local_sparse_embedding_and_its_optimizer_do(
    recording: Recording, rule: Any, optimizer: Any
) -> None:
    n = 12  # ids BASE .. BASE + 11; each batch touches some, several twice or more
    await recording.create_table("t", DIM, init="uniform", scale=0.5, rule=rule)
    emb = ps_torch.Embedding(recording, "t", DIM)
    steps = batches(0, 6, n, (3, 5))
    target = torch.linspace(-1, 1, DIM)
    initial = await recording.client.pull_rows("t", np.arange(n, dtype=np.int64) + BASE)

    local = torch.nn.Embedding(n, DIM, sparse=True)
    with torch.no_grad():
        local.weight.copy_(torch.from_numpy(np.array(initial)))
    opt = optimizer(local.parameters())
    with torch.sparse.check_sparse_tensor_invariants():  # opting in silences torch's warning
        for ids in steps:
            opt.zero_grad()
            loss_of(local(ids), target).backward()
            opt.step()

    await _train_on_node(recording, emb, steps, target)
    # One push a step, each unique id once, with its repeats' gradients summed in.
    assert len(recording.pushes) == len(steps)
    for (ids, grads, _), batch in zip(recording.pushes, steps, strict=True):
        np.testing.assert_array_equal(ids, torch.unique(batch).numpy() + BASE)
        assert grads.shape == (len(ids), DIM)
    got = await recording.client.pull_rows("t", np.arange(n, dtype=np.int64) + BASE)
    np.testing.assert_allclose(got, local.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert emb.rows is None and "nothing pulled" in repr(emb)  # a push clears


@pytest.mark.parametrize("mode", ["sum", "mean"])
async def test_a_bag_folds_as_a_local_sparse_embedding_bag_does(
    recording: Recording, mode: str
) -> None:
    n = 10
    await recording.create_table("t", DIM, init="normal", scale=0.3, rule=sgd(0.1))
    bag = ps_torch.EmbeddingBag(recording, "t", DIM, mode=mode)
    initial = await recording.client.pull_rows("t", np.arange(n, dtype=np.int64) + BASE)
    local = torch.nn.EmbeddingBag(n, DIM, mode=mode, sparse=True)
    with torch.no_grad():
        local.weight.copy_(torch.from_numpy(np.array(initial)))
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    target = torch.linspace(1, -1, DIM)
    flat = batches(1, 4, n, (9,))
    offsets = torch.tensor([0, 2, 2, 6])  # bags of 2, 0, 4 and 3 ids (an empty one)
    for ids in flat:
        opt.zero_grad()
        loss_of(local(ids, offsets), target).backward()
        opt.step()
    await _train_on_node(recording, bag, flat, target, offsets=offsets)
    square = batches(2, 3, n, (4, 3))  # 2-D ids: a bag per row
    for ids in square:
        opt.zero_grad()
        loss_of(local(ids), target).backward()
        opt.step()
    await _train_on_node(recording, bag, square, target)
    got = await recording.client.pull_rows("t", np.arange(n, dtype=np.int64) + BASE)
    np.testing.assert_allclose(got, local.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    await bag.pull(flat[0] + BASE)
    with pytest.raises(ValueError, match="1-D ids need offsets"):
        bag(flat[0] + BASE)
    with pytest.raises(ValueError, match="take no offsets"):
        bag((flat[0] + BASE).reshape(3, 3), offsets)
    with pytest.raises(ValueError, match="mode is one of sum, mean"):
        ps_torch.EmbeddingBag(recording, "t", DIM, mode="max")


async def test_rows_pulled_but_unused_are_not_pushed(recording: Recording) -> None:
    # Lazy adam would step a row pushed a zero gradient: only used rows go.
    await recording.create_table("t", DIM, init="normal", scale=0.1, rule=adam(0.1))
    emb = ps_torch.Embedding(recording, "t", DIM)
    before = await recording.client.pull_rows("t", np.array([1, 2, 3], np.int64))
    await emb.pull(torch.tensor([1, 2, 3]))
    with torch.no_grad():
        emb(torch.tensor([3]))  # not for training: does not count as used
    emb(torch.tensor([1, 1])).sum().backward()
    result = await emb.push()
    assert (result.rows, result.created) == (1, 1)  # (a pull makes no row; a push does)
    np.testing.assert_array_equal(recording.pushes[0][0], [1])
    after = await recording.client.pull_rows("t", np.array([1, 2, 3], np.int64))
    assert not np.array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1:], before[1:])


async def test_misuse_is_refused_before_anything_is_sent(recording: Recording) -> None:
    await recording.create_table("t", DIM, rule=sgd(1.0))
    emb = ps_torch.Embedding(recording, "t", DIM)
    with pytest.raises(RuntimeError, match=r"no rows pulled: await pull\(ids\)"):
        emb(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="nothing pulled to push"):
        await emb.push()
    await emb.pull(torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match=r"2 id\(s\) were not pulled \(3, 4\)"):
        emb(torch.tensor([1, 3, 4, 4]))
    with pytest.raises(TypeError, match="ids are integers"):
        emb(torch.tensor([1.0]))
    emb(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"no gradient: call loss.backward\(\) before push"):
        await emb.push()
    assert recording.pushes == []
    # A second pull replaces the first, its rows (and any gradient) dropped.
    emb(torch.tensor([2])).sum().backward()
    await emb.pull(torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="were not pulled"):
        emb(torch.tensor([2]))
    emb(torch.tensor([6])).sum().backward()
    await emb.push()
    np.testing.assert_array_equal(recording.pushes[0][0], [6])
    got = await recording.client.pull_rows("t", np.array([1, 2, 6], np.int64))
    np.testing.assert_array_equal(got, [[0] * DIM, [0] * DIM, [-1] * DIM])
    # A push clears: neither a forward nor another push until the next pull.
    with pytest.raises(RuntimeError, match="no rows pulled"):
        emb(torch.tensor([6]))
    with pytest.raises(RuntimeError, match="nothing pulled to push"):
        await emb.push()
    # One pull or push at a time on a module.
    first = asyncio.ensure_future(emb.pull(torch.tensor([1])))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cannot pull: a pull is in progress"):
        await emb.pull(torch.tensor([2]))
    await first
    assert len(recording.pulls) == 3


async def test_wrong_tables_and_arguments_are_named(recording: Recording) -> None:
    await recording.create_table("t", DIM)
    with pytest.raises(ValueError, match="rows of width 4, this Embedding was made with dim=8"):
        await ps_torch.Embedding(recording, "t", 8).pull(torch.tensor([1]))
    with pytest.raises(RequestError, match="no table 'nope'"):
        await ps_torch.Embedding(recording, "nope", DIM).pull(torch.tensor([1]))
    with pytest.raises(TypeError, match="given with create=False"):
        ps_torch.Embedding(recording, "t", DIM, init="normal")
    with pytest.raises(TypeError, match="unknown argument"):
        ps_torch.Embedding(recording, "t", DIM, create=True, lr=0.1)
    with pytest.raises(ValueError, match="dim is an int >= 1"):
        ps_torch.Embedding(recording, "t", 0)
    with pytest.raises(TypeError, match="ids are integers"):
        await ps_torch.Embedding(recording, "t", DIM).pull(torch.tensor([0.5]))
    # An empty batch asks the node nothing, and pushes nothing.
    recording.pulls.clear()
    emb = ps_torch.Embedding(recording, "t", DIM)
    assert (await emb.pull(torch.tensor([], dtype=torch.int64))).shape == (0, DIM)
    emb(torch.tensor([], dtype=torch.int64)).sum().backward()
    assert (await emb.push()).rows == 0
    assert recording.pulls == [] and recording.pushes == []


async def test_create_true_makes_the_table_at_the_first_pull(recording: Recording) -> None:
    emb = ps_torch.Embedding(
        recording, "made", DIM, create=True, dtype="float64", init="normal", scale=0.1
    )
    rows = await emb.pull(torch.tensor([1, 2]))
    assert rows.dtype == torch.float64
    [table] = await recording.tables()
    assert (table.name, table.dim, table.init, table.rule.kind) == (
        "made",
        DIM,
        "normal",
        "adagrad",
    )
    # Another module creating the same table is no error.
    again = ps_torch.Embedding(
        recording, "made", DIM, create=True, dtype="float64", init="normal", scale=0.1
    )
    np.testing.assert_array_equal((await again.pull(torch.tensor([2]))).detach(), rows[1:].detach())


async def test_a_push_whose_reply_was_lost_is_sent_again_and_folded_once(
    recording: Recording,
) -> None:
    await recording.create_table("t", DIM, rule=sgd(1.0))
    emb = ps_torch.Embedding(recording, "t", DIM)
    await emb.pull(torch.tensor([1]))
    emb(torch.tensor([1])).sum().backward()
    recording.fail_after_push = True
    with pytest.raises(CallTimeout):
        await emb.push()
    assert emb.rows is not None and emb.rows.grad is not None  # kept, to push again
    await emb.push()
    assert recording.pushes[0][2] == recording.pushes[1][2] is not None  # one request id
    np.testing.assert_array_equal(
        await recording.client.pull_rows("t", np.array([1], np.int64)), [[-1] * DIM]
    )


async def test_a_model_with_a_dense_part_on_a_local_adam_learns(client: ParameterClient) -> None:
    """Two ids per sample, each with a hidden value; the label is their sum."""
    torch.manual_seed(0)
    n, dim, batch = 40, 8, 32
    hidden = torch.randn(n)
    await client.create_table("ids", dim, init="normal", scale=0.1, rule=adagrad(0.2))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = ps_torch.Embedding(client, "ids", dim)
            self.head = torch.nn.Linear(2 * dim, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids).flatten(1)).squeeze(1)

    model = Model()
    assert [name for name, _ in model.named_parameters()] == ["head.weight", "head.bias"]
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(150):
        local = torch.randint(0, n, (batch, 2), generator=g)
        await model.emb.pull(local + BASE)
        loss = (model(local + BASE) - hidden[local].sum(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        await model.emb.push()
        losses.append(loss.item())
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.2 * first, f"mean squared error {first:.3f} -> {last:.3f}"
