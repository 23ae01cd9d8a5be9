"""The client: addresses, connections, the pool and the numpy API (:class:`ParameterClient`).

``addresses`` (where to connect, deadlines checked), ``connection`` (one
pipelined connection), ``pool`` (the connections, retries), ``api`` (the
public methods), ``updates`` and ``fetch`` (what goes in pieces, both ways).
"""

from .api import ParameterClient

__all__ = ["ParameterClient"]
