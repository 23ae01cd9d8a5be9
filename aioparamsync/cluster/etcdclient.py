"""etcd's client, as the coordinator makes it: aetcd's, over TLS when asked.

The client is ``aetcd`` (the ``[etcd]`` extra), imported only when a
coordinator is asked for (:func:`client_class` raises ``ImportError``
without it). aetcd speaks plain gRPC only: over TLS, its channel is made a
secure one as it connects.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["client_class", "credentials", "refresh", "watch_from"]

log = logging.getLogger("aioparamsync.cluster.coordinator")


def client_class() -> Any:
    """aetcd's client class, over TLS when given credentials.

    Raises:
        ImportError: aetcd (or grpc) is not installed.
    """
    import aetcd
    import grpc

    class Client(aetcd.Client):
        """aetcd's client, over TLS when given credentials (it speaks plain gRPC only)."""

        def __init__(self, host: str, port: int, credentials: Any = None) -> None:
            super().__init__(host=host, port=port)
            self._credentials = credentials

        async def connect(self) -> None:
            if self._credentials is None:
                await super().connect()
                return
            target = f"{self._host}:{self._port}"
            real = aetcd.rpc.insecure_channel
            aetcd.rpc.insecure_channel = lambda t, options: grpc.aio.secure_channel(
                t, self._credentials, options=options
            )
            try:
                await super().connect()
            finally:
                aetcd.rpc.insecure_channel = real
            log.debug("coordinator: TLS to %s", target)

    return Client


def credentials(tls: tuple[str, str | None, str | None] | None) -> Any:
    """gRPC's credentials of (ca, cert, key) file paths (None: plain, no credentials)."""
    if tls is None:
        return None
    import grpc

    ca, cert, key = tls

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    # (a key in the certificate's file, when it has none of its own)
    return grpc.ssl_channel_credentials(read(ca), read(key or cert), read(cert))


async def refresh(client: Any, lease: int) -> Any:
    """Renew ``lease``: etcd's answer (its TTL is 0 or less once the lease expired)."""
    return await client.refresh_lease(lease)


async def watch_from(client: Any, prefix: bytes, revision: int) -> tuple[Any, Any]:
    """A watch of ``prefix`` from ``revision`` on, and the client it is on."""
    return client, await client.watch_prefix(prefix, start_revision=revision)
