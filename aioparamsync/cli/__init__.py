"""The command lines: ``aioparamsync-node`` (:mod:`.node`), ``aioparamsync-ctl`` (:mod:`.ctl`).

Both read their flags' values with :mod:`.options`; ctl prints with :mod:`.output`.
"""
