"""``python -m blutrain.cli``: the ``blutrain`` command where no console script is installed."""

import sys

from blutrain.cli import main

sys.exit(main())
