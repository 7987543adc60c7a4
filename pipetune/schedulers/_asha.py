"""Asynchronous successive halving (ASHA, Li et al. 2020)."""

from __future__ import annotations

import bisect
import math
import warnings

from pipetune.schedulers._base import Decision, Scheduler, _check_int

MODES: tuple[str, ...] = ("max", "min")

#: Weight, in trials, of ASHA's prior promotion rate (``1 / reduction_factor``) in a
#: rung's observed rate: before any trial is decided at a rung the prior alone; after
#: one, not yet 0 or 1 (a single stop or pass says little).
PRIOR_TRIALS = 1.0


def _quantile(values: list[float], q: float, *, presorted: bool = False) -> float:
    """The ``q`` quantile with linear interpolation between order statistics.

    The same as ``numpy.percentile(values, 100 * q)`` with its default method.
    """
    xs = values if presorted else sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


class ASHAScheduler(Scheduler):
    """Stops trials that fall behind at rungs, without waiting for a full cohort.

    Rungs sit at ``min_epochs * reduction_factor**k`` epochs for k = 0, 1, ...,
    strictly below ``max_epochs`` (see :attr:`rungs`). When a trial reports the epoch
    of a rung, its value is compared with the values other trials reached at that
    rung so far: the cutoff is their ``1 - 1/reduction_factor`` quantile (linear
    interpolation), the rule Ray Tune's ``AsyncHyperBandScheduler`` uses. The trial is
    stopped if it scores worse than the cutoff (``mode`` says which way is better);
    otherwise it continues. Either way its value is noted at the rung. The first
    trial to reach a rung has nothing to compare with and continues. A value that is
    NaN or infinite stops the trial and is not noted.

    Reporting the same rung twice for a trial (a retried epoch) re-decides against
    the other trials' values and replaces its earlier value there.

    >>> asha = ASHAScheduler(min_epochs=1, max_epochs=4, reduction_factor=2)
    >>> asha.rungs
    (1, 2)
    >>> [asha.on_epoch_result(t, 1, v).value for t, v in enumerate([0.5, 0.4, 0.6])]
    ['continue', 'stop', 'continue']
    """

    def __init__(
        self,
        min_epochs: int = 1,
        max_epochs: int = 10,
        reduction_factor: int = 2,
        mode: str = "max",
    ) -> None:
        super().__init__(max_epochs)
        _check_int("min_epochs", min_epochs, 1)
        if min_epochs > max_epochs:
            raise ValueError(f"min_epochs must be <= max_epochs ({max_epochs}), got {min_epochs}")
        _check_int("reduction_factor", reduction_factor, 2)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.min_epochs = min_epochs
        self.reduction_factor = reduction_factor
        self.mode = mode
        rungs = []
        epoch = min_epochs
        while epoch < max_epochs:
            rungs.append(epoch)
            epoch *= reduction_factor
        self._rungs = tuple(rungs)
        # rung epoch -> trial_id -> value, oriented so that larger is better
        self._values: dict[int, dict[int, float]] = {r: {} for r in self._rungs}
        #: The same values per rung, kept sorted: a decision costs the same at any size.
        self._ranked: dict[int, list[float]] = {r: [] for r in self._rungs}
        # rung epoch -> trial_id -> whether it went on past the rung
        self._promoted: dict[int, dict[int, bool]] = {r: {} for r in self._rungs}

    @property
    def rungs(self) -> tuple[int, ...]:
        """Epochs at which trials are compared, ascending."""
        return self._rungs

    def sure_epochs(self, epochs_run: int) -> int:
        """Epochs until the next rung above ``epochs_run`` (a trial may be stopped
        there), else until ``max_epochs``.

        >>> ASHAScheduler(min_epochs=1, max_epochs=9, reduction_factor=3).sure_epochs(1)
        2
        """
        later = [r for r in self._rungs if r > epochs_run]
        return (later[0] if later else self.max_epochs) - epochs_run

    def promotion_rate(self, rung: int) -> float:
        """The share of trials that went on past ``rung`` in this study, drawn towards
        ASHA's prior ``1 / reduction_factor`` by :data:`PRIOR_TRIALS` (the prior alone
        before any trial was decided there).

        >>> asha = ASHAScheduler(min_epochs=1, max_epochs=4, reduction_factor=2)
        >>> asha.promotion_rate(1)
        0.5
        >>> [asha.on_epoch_result(t, 1, v).value for t, v in enumerate([0.5, 0.6])]
        ['continue', 'continue']
        >>> round(asha.promotion_rate(1), 3)
        0.833
        """
        decided = self._promoted[rung]
        prior = 1.0 / self.reduction_factor
        return (sum(decided.values()) + prior * PRIOR_TRIALS) / (len(decided) + PRIOR_TRIALS)

    def expected_epochs(self, epochs_run: int) -> float:
        """Epochs the trial is expected to run from now on (the next one included):
        epoch ``e`` counts with the chance of passing every rung between here and it,
        each rung's chance its :meth:`promotion_rate` so far.

        >>> round(ASHAScheduler(min_epochs=1, max_epochs=6, reduction_factor=2)
        ...       .expected_epochs(1), 3)
        2.5
        """
        total, reach = 0.0, 1.0
        for epoch in range(epochs_run + 1, self.max_epochs + 1):
            before = epoch - 1
            if before > epochs_run and before in self._promoted:
                reach *= self.promotion_rate(before)
            total += reach
        return total

    def values_at(self, rung: int) -> dict[int, float]:
        """Values noted at ``rung`` so far: ``trial_id -> value`` as reported."""
        sign = 1.0 if self.mode == "max" else -1.0
        return {t: sign * v for t, v in self._values[rung].items()}


    def recorded(self, rung: int) -> dict[int, float]:
        """Deprecated name of :meth:`values_at`; it goes in the next release."""
        warnings.warn("ASHAScheduler.recorded is now ASHAScheduler.values_at; the old name "
                      "goes in the next release", DeprecationWarning, stacklevel=2)
        return self.values_at(rung)
    def _decide(self, trial_id: int, epoch: int, value: float) -> Decision:
        values = self._values.get(epoch)
        if values is None:
            return Decision.CONTINUE
        ranked = self._ranked[epoch]
        before = values.pop(trial_id, None)
        if before is not None:  # told again: its earlier value is not one of the others
            del ranked[bisect.bisect_left(ranked, before)]
        if not math.isfinite(value):
            self._promoted[epoch][trial_id] = False
            return Decision.STOP
        score = value if self.mode == "max" else -value
        stop = bool(ranked) and score < _quantile(ranked, 1.0 - 1.0 / self.reduction_factor,
                                                   presorted=True)
        values[trial_id] = score
        bisect.insort(ranked, score)
        self._promoted[epoch][trial_id] = not stop
        return Decision.STOP if stop else Decision.CONTINUE
