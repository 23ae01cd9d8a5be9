"""Durability: the write-ahead log, safetensors snapshots, and recovery from them.

- :mod:`.wal`: the write-ahead log: its records and segments, appending and
  syncing, reading back, cutting a torn tail.
- :mod:`.snapshot`: a snapshot of the table (safetensors, with the JSON of
  versions and origins beside it): writing it, checking it, merging it into a table.
- :mod:`.safetensors_format`: the safetensors layout (dtype names, the header),
  which the snapshots and ``aioparamsync-ctl export`` write.
- :mod:`.datadir`: the directory holding both: its lock, what lives where,
  recovery (the newest snapshot, then the log), and :class:`~.datadir.DataDir`,
  which the store's writer talks to.
"""

from __future__ import annotations

from ..errors import ParamSyncError

__all__ = ["PersistenceError"]


class PersistenceError(ParamSyncError):
    """The data directory cannot be used as it is (damaged, or not ours)."""
