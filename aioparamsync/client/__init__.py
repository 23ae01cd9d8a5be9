"""The client: addresses, connections, the pool and the numpy API (:class:`ParameterClient`)."""

from .api import ParameterClient

__all__ = ["ParameterClient"]
