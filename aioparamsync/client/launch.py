"""Who this worker is, as its launcher says: torchrun, a PyTorchJob, a Kubernetes Indexed Job.

Launchers tell each worker its place by environment: torchrun (and the
Kubeflow PyTorchJob) set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; a
Kubernetes Indexed Job sets ``JOB_COMPLETION_INDEX`` (its world size is the
Job's ``completions``, given as ``WORLD_SIZE``). :meth:`Launch.from_env`
reads them, and the nodes' addresses as :meth:`ParameterClient.from_env`
does (``AIOPARAMSYNC_ADDRESSES``), so a training script needs no flags of its
own::

    launch = Launch.from_env()
    async with launch.client() as client:
        ...
        await launch.barrier(client, "epoch", epoch)

Nothing here needs torch (``aioparamsync.torch`` re-exports it); no process
group is made: the nodes are how the workers share their parameters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import ParameterClient

__all__ = ["Launch"]


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number") from None


@dataclass(frozen=True)
class Launch:
    """A worker's place among its peers (see the module)."""

    #: this worker's index, 0 <= rank < world_size
    rank: int
    #: how many workers there are
    world_size: int
    #: its index on its machine (torchrun's LOCAL_RANK; else its rank)
    local_rank: int
    #: the environment it was read from (the client reads the nodes' addresses there)
    environ: Mapping[str, str]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Launch:
        """Read ``RANK`` (else ``JOB_COMPLETION_INDEX``), ``WORLD_SIZE`` and ``LOCAL_RANK``.

        Raises:
            ValueError: one is missing or not what it should be (the message names it).
        """
        environ = dict(os.environ if environ is None else environ)
        rank = _integer(environ, "RANK")
        if rank is None:
            rank = _integer(environ, "JOB_COMPLETION_INDEX")
        world_size = _integer(environ, "WORLD_SIZE")
        if rank is None or world_size is None:
            missing = [n for n, v in (("RANK", rank), ("WORLD_SIZE", world_size)) if v is None]
            raise ValueError(
                f"{' and '.join(missing)} not set: launch the workers with torchrun (or a "
                "PyTorchJob, or an Indexed Job with WORLD_SIZE), or set RANK and WORLD_SIZE"
            )
        if world_size < 1:
            raise ValueError(f"WORLD_SIZE={world_size}: there is at least one worker")
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is not in 0..{world_size - 1} (WORLD_SIZE={world_size})")
        local_rank = _integer(environ, "LOCAL_RANK")
        if local_rank is not None and local_rank < 0:
            raise ValueError(f"LOCAL_RANK={local_rank} is negative")
        return cls(rank, world_size, rank if local_rank is None else local_rank, environ)

    @property
    def worker(self) -> str:
        """This worker's name in barriers: ``"rank<N>"``."""
        return f"rank{self.rank}"

    @property
    def is_first(self) -> bool:
        """Whether this is rank 0 (the one that creates the parameters, and ends the job)."""
        return self.rank == 0

    def client(self, **kwargs: Any) -> ParameterClient:
        """A client of the nodes the environment names (:meth:`ParameterClient.from_env`)."""
        from .api import ParameterClient

        return ParameterClient.from_env(self.environ, **kwargs)

    async def barrier(
        self, client: ParameterClient, group: str, step: int, *, timeout: float | None = 600.0
    ) -> Any:
        """Wait until every worker of the launch has reached ``step`` of ``group``."""
        return await client.barrier(group, self.worker, step, self.world_size, timeout=timeout)
