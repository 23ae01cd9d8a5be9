"""The command lines: ``aioparamsync-node`` (:mod:`.node`), ``aioparamsync-ctl`` (:mod:`.ctl`)."""
