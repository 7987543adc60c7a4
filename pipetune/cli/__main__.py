"""``python -m pipetune.cli``: the same as ``pipetune``."""

import sys

from pipetune.cli import main

sys.exit(main())
