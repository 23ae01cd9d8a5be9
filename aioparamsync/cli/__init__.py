"""The command lines: ``aioparamsync-node`` (:mod:`.node`), ``aioparamsync-ctl`` (:mod:`.ctl`).

Both read their flags' values with :mod:`.options` (the node's also from the
environment: :mod:`.environ`); ctl's parser is
:mod:`.ctl_parser`, it prints with :mod:`.output`, and its ``export`` is
:mod:`.export`.
"""
