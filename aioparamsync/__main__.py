import sys

from .cli.node import main

sys.exit(main())
