"""``python -m kvsim``: see :mod:`kvsim.cli`."""

import sys

from kvsim.cli import main

sys.exit(main())
