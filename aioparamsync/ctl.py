"""``python -m aioparamsync.ctl``: the operator's command, ``aioparamsync-ctl`` (see
:mod:`aioparamsync.cli.ctl`)."""

import sys

from .cli.ctl import main

if __name__ == "__main__":
    sys.exit(main())
