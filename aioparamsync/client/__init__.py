"""The client: addresses, connections, the pool and the numpy API (:class:`ParameterClient`).

``addresses`` (where to connect, deadlines checked), ``connection`` (one
pipelined connection), ``pool`` (the connections, retries), ``api`` (the
public methods), ``updates`` and ``fetch`` (what goes in pieces, both ways),
``blocking`` (:class:`SyncParameterClient`: the same methods, for synchronous code).
"""

from .api import ParameterClient
from .blocking import SyncParameterClient

__all__ = ["ParameterClient", "SyncParameterClient"]
