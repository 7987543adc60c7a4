"""Deprecated: the plain-Optuna peer moved to :mod:`pipetune.bench.optuna_plain`.

``import pipetune.bench_optuna`` and ``python -m pipetune.bench_optuna`` keep working,
with a :class:`DeprecationWarning`, for one release.
"""

from __future__ import annotations

import sys
import warnings

import pipetune.bench.optuna_plain as _moved

warnings.warn("pipetune.bench_optuna is now pipetune.bench.optuna_plain; the old name "
              "goes in the next release", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    print("warning: `python -m pipetune.bench_optuna` is deprecated; use `python -m "
          "pipetune.bench.optuna_plain`", file=sys.stderr)
    sys.exit(_moved.main())
else:
    sys.modules[__name__] = _moved
