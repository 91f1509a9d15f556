"""``python -m gspo_ascend ...`` = the ``gspo-ascend`` command, for an interpreter whose scripts are not on PATH
(a package set put on PYTHONPATH rather than installed: the GPU proof's carried bundle, scripts/device/)."""

import sys

from .cli import main

sys.exit(main())
