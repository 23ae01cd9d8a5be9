"""TLS contexts for a node's port, its peer links, and clients."""

from __future__ import annotations

import ssl

__all__ = ["client_context", "server_context"]


def server_context(
    certfile: str, keyfile: str | None = None, cafile: str | None = None
) -> ssl.SSLContext:
    """The context a node serves TLS with.

    Args:
        certfile: the node's certificate chain (PEM).
        keyfile: its private key (PEM), if not in ``certfile``.
        cafile: CA certificates: with it, clients must present a certificate it signed.

    Raises:
        OSError, ssl.SSLError: a file cannot be read or is not what it should be.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    if cafile:
        context.load_verify_locations(cafile)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(
    cafile: str | None = None, certfile: str | None = None, keyfile: str | None = None
) -> ssl.SSLContext:
    """A context to reach nodes over TLS (peer links use it too).

    Args:
        cafile: CA certificates to verify nodes with (default: the system's).
        certfile, keyfile: a certificate to present, for nodes that require one.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    if certfile:
        context.load_cert_chain(certfile, keyfile)
    return context
