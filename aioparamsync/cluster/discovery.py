"""Discovery by DNS: the members are every address of one name (``--peers-dns NAME:PORT``).

Theory of operation. A Kubernetes headless Service (``clusterIP: None``) has
one DNS name whose A/AAAA records are the addresses of its pods; with
``publishNotReadyAddresses: true`` they are there as soon as a pod has an
address, before it is ready, so nodes that start together find each other.
:class:`DnsDiscovery` resolves the name when the node starts (what it finds
are its seeds, as ``--peers`` would be) and again every ``interval``
seconds, and adds each address that was not there at the previous
resolution as a member (:meth:`Cluster.add`). So pods that come are
members without a static list. An address that goes away is not removed:
its member's link goes down and, past the failure timeout, it leaves
placement, as any member that stops answering (a pod that leaves on purpose
says so first: see the drain). The node's own address is among those of the
name: its link reaches itself and is dropped, as any such link.

A name that does not resolve (yet: the Service may be created after the
pods) is logged and tried again at the next round; it stops no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .membership import Cluster

__all__ = ["DEFAULT_INTERVAL", "DnsDiscovery", "Resolver", "resolve_all"]

log = logging.getLogger(__name__)

#: how often the name is resolved again (seconds)
DEFAULT_INTERVAL = 10.0

#: ``(name, port)`` -> every ``(address, port)`` of the name
Resolver = Callable[[str, int], Awaitable[list[tuple[str, int]]]]


async def resolve_all(name: str, port: int) -> list[tuple[str, int]]:
    """Every address of ``name`` (IPv4 and IPv6), by the system's resolver, sorted.

    Raises:
        OSError: (``socket.gaierror``) the name does not resolve.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({(str(info[4][0]), port) for info in infos})


class DnsDiscovery:
    """Members by DNS for one cluster (see the module).

    Args:
        cluster: the node's cluster, to add members to.
        name, port: what to resolve, and the port of every member.
        interval: seconds between resolutions.
        resolve: the resolver (default: the system's, :func:`resolve_all`).
    """

    def __init__(
        self,
        cluster: Cluster,
        name: str,
        port: int,
        *,
        interval: float = DEFAULT_INTERVAL,
        resolve: Resolver | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the interval of DNS discovery must be above 0, not {interval}")
        self.cluster = cluster
        self.name = name
        self.port = port
        self.interval = interval
        self.resolve = resolve or resolve_all
        #: the addresses the last resolution answered
        self.addresses: list[tuple[str, int]] = []
        self.resolutions = 0  # rounds that answered
        self.failures = 0  # rounds that did not
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<DnsDiscovery {self.name}:{self.port} {len(self.addresses)} addresses>"

    async def seeds(self) -> list[tuple[str, int]]:
        """Resolve the name now: the addresses found (none when it does not resolve)."""
        await self._round()
        return list(self.addresses)

    def start(self) -> None:
        """Resolve again every ``interval`` seconds, adding the addresses that appear."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="aioparamsync-dns-discovery")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            before = set(self.addresses)
            if not await self._round():
                continue
            for host, port in self.addresses:
                if (host, port) not in before:
                    self.cluster.add(host, port)

    async def _round(self) -> bool:
        """Resolve once; False (logged) when the name does not resolve."""
        try:
            found = await self.resolve(self.name, self.port)
        except OSError as exc:
            self.failures += 1
            level = (
                logging.WARNING if self.failures == 1 or self.failures % 30 == 0 else logging.DEBUG
            )
            log.log(level, "%s:%d does not resolve (%s); trying again", self.name, self.port, exc)
            return False
        found = sorted(set(found))
        if found != self.addresses:
            shown = ", ".join(f"{h}:{p}" for h, p in found) or "no address"
            log.info("%s:%d resolves to %s", self.name, self.port, shown)
        self.addresses = found
        self.resolutions += 1
        return True
