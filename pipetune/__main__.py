"""``python -m pipetune``: the same as the ``pipetune`` command."""

import sys

from pipetune.cli import main

sys.exit(main())
