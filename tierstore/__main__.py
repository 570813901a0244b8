"""``python -m tierstore``: the ``tierstore`` command line."""

import sys

from .cli import main

sys.exit(main())
