"""What each worker has paid once: the one-time costs (a compile) it measured per model
graph and batch size, so a later trial on the same worker weighs what it will really pay.

A worker that compiled a model graph once compiles the same architecture for a new
trial in about no time (dynamo reuses what it traced; measured here: 0.0 s against
8.6 s for the first). The first one-time cost a worker pays for a graph is its *first*;
every later trial's first epoch under the same one-time knobs there is a *reuse*, and
what reuses measured is what the next trial on that worker is told it will pay.

>>> ledger = OneTimeLedger()
>>> ledger.paid("tcp://w1", "g", 64, ("compile",), 8.6)
>>> ledger.estimate("tcp://w1", "g", 64, ("compile",))
(0.0, 'assumed')
>>> ledger.paid("tcp://w1", "g", 64, ("compile",), 0.2)
>>> ledger.estimate("tcp://w1", "g", 64, ("compile",))
(0.2, 'measured')
>>> ledger.estimate("tcp://w2", "g", 64, ("compile",)) is None
True
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipetune.space import Choice, IntUniform, LogUniform, Uniform
from pipetune.spec import SYSTEM_HPARAM_PREFIX
from pipetune.system.config import ONE_TIME_KNOBS
from pipetune.tuner import ONE_TIME_PRICE_PRIOR_S, ONE_TIME_SAVING_PRIOR, OneTimePrice
from pipetune.tuner.one_time import per_wall_second

if TYPE_CHECKING:
    from pipetune.engine.study import Study
    from pipetune.engine.trial import Trial
    from pipetune.groundtruth import GroundTruth
    from pipetune.runner import EpochResult
    from pipetune.schedulers import Scheduler
    from pipetune.spec import JobSpec

#: (worker address, model graph, batch size, one-time knobs that ran)
Key = tuple[str, str, int, tuple[str, ...]]


@dataclass
class _Paid:
    first: float
    reuses: list[float] = field(default_factory=list)
    #: The first in wall seconds (what a wall second of its config cost taken out).
    first_wall_s: float = 0.0


class OneTimeLedger:
    """Per worker, graph, batch size and one-time knobs: the first cost and the reuses.

    ``machine``: what one-time knobs cost once (wall seconds) and saved for any job the
    ground truth holds (:meth:`pipetune.groundtruth.GroundTruth.one_time_figures`), read
    when first needed and again after this study paid a new first; None: nothing to
    read."""

    def __init__(self,
                 machine: Callable[[], tuple[float | None, float, int] | None] | None = None,
                 prior: OneTimePrice | None = None) -> None:
        self._paid: dict[Key, _Paid] = {}
        self._machine = machine
        #: What is assumed before anything was measured (``pipetune.one_time_*``).
        self.prior = prior or OneTimePrice()
        self._machine_read: tuple[int, tuple[float | None, float, int] | None] | None = None

    @classmethod
    def for_study(cls, spec: JobSpec, ground_truth: GroundTruth | None) -> OneTimeLedger:
        """A study's ledger: the machine's figures read from ``ground_truth``, the priors
        from the job's ``pipetune.one_time_price_s`` and ``one_time_saving``."""
        given = spec.pipetune
        prior = OneTimePrice(
            saving=ONE_TIME_SAVING_PRIOR if given.one_time_saving is None
            else given.one_time_saving,
            prior_s=ONE_TIME_PRICE_PRIOR_S if given.one_time_price_s is None
            else given.one_time_price_s)
        objective = spec.objective.system
        return cls(None if ground_truth is None else
                   (lambda: ground_truth.one_time_figures(objective)), prior)

    def price(self) -> OneTimePrice:
        """What an untried one-time knob is expected to cost once and save in this
        study: the price (wall seconds) is the median first this study paid (any
        worker, any graph of it), else the ground truth's, else the prior; the saving
        is the ground truth's, else the prior."""
        firsts = [p.first_wall_s for p in self._paid.values()]
        if self._machine is not None and (self._machine_read is None
                                          or self._machine_read[0] != len(firsts)):
            self._machine_read = (len(firsts), self._machine())
        machine = self._machine_read[1] if self._machine_read is not None else None
        saving = machine[1] if machine is not None else self.prior.saving
        if firsts:
            return dataclasses.replace(self.prior, price=statistics.median(firsts),
                                       saving=saving,
                                       source=f"this study's {len(firsts)} first(s)")
        if machine is not None and machine[0] is not None:
            return dataclasses.replace(self.prior, price=machine[0], saving=saving,
                                       source=f"ground truth, {machine[2]} job(s)")
        return dataclasses.replace(self.prior, saving=saving)

    def paid(self, address: str, graph: str, batch_size: int, knobs: tuple[str, ...],
             one_time: float, per_wall_s: float = 1.0) -> None:
        """A trial's first epoch under ``knobs`` on ``address`` cost ``one_time`` once (in
        the objective's units for the whole epoch; ``per_wall_s``: what a wall second
        of that epoch's config cost in them)."""
        key = (address, graph, int(batch_size), tuple(sorted(knobs)))
        known = self._paid.get(key)
        if known is None:
            self._paid[key] = _Paid(float(one_time),
                                    first_wall_s=float(one_time) / max(per_wall_s, 1e-12))
        else:
            known.reuses.append(float(one_time))

    def estimate(self, address: str, graph: str, batch_size: int,
                 knobs: tuple[str, ...]) -> tuple[float, str] | None:
        """What a new trial will pay once for ``knobs`` on ``address``, and whether that
        was ``measured`` (the median of the reuses there) or ``assumed`` (the worker
        paid its first only: a reuse costs about nothing); None where it paid nothing
        yet for this graph."""
        known = self._paid.get((address, graph, int(batch_size), tuple(sorted(knobs))))
        if known is None:
            return None
        if known.reuses:
            return statistics.median(known.reuses), "measured"
        return 0.0, "assumed"

    def note(self, trial: Trial, result: EpochResult) -> None:
        """``result``, the trial's newest epoch: where it is the first under its one-time
        knobs on its worker, what that worker paid, for the trials that come to it later."""
        knobs = result.system.one_time_knobs()
        earlier = trial.results[:-1]
        if not knobs or (earlier and earlier[-1].system.one_time_knobs() == knobs
                         and earlier[-1].address == result.address):
            return
        where = graph_of(trial)
        if where is not None:
            seen = trial.history[-1]
            self.paid(*where, knobs, seen.one_time, per_wall_second(seen))

    def for_next_epoch(self, trial: Trial) -> float | None:
        """What the one-time knobs cost on the worker of the trial's next epoch, where it
        paid them for this graph before (:meth:`estimate`); None where unknown."""
        where = graph_of(trial)
        if where is None:
            return None
        known = self.estimate(*where, ONE_TIME_KNOBS)
        return None if known is None else known[0]


def graph_of(trial: Trial) -> tuple[str, str, int] | None:
    """Where the trial's next epoch runs (the worker holding its model), its model graph
    and batch size; None before its first epoch or where unknown."""
    if not trial.results:
        return None
    graph = next((r.graph for r in trial.results if r.graph), "")
    last = trial.results[-1]
    return (last.address, graph, last.batch_size) if graph else None


def later_epochs_per_slot(spec: JobSpec, scheduler: Scheduler, trials_left: int) -> float:
    """The epochs after their profiled first that ``trials_left`` trials not yet
    started are expected to run, per slot: what a compile paid on a worker now also
    saves, where every trial builds the same model graph (no model-shaping
    hyperparameter varies: a worker compiles it once and later trials reuse it, see
    :class:`OneTimeLedger`); 0 where trials may build other graphs, or none is left.
    Slots are taken as ``search.max_concurrent`` workers sharing the trials evenly."""
    if trials_left <= 0 or spec.early_stopping.max_epochs < 2 \
            or not one_graph_for_every_trial(spec):
        return 0.0
    try:  # every trial runs its profiled first epoch: what may follow it
        each = float(scheduler.expected_epochs(0)) - 1.0
    except (TypeError, ValueError):  # a scheduler of the user's that cannot say
        return 0.0
    if not math.isfinite(each):
        return 0.0
    each = min(max(each, 0.0), spec.early_stopping.max_epochs - 1)
    return trials_left * each / max(1, spec.search.max_concurrent)


def trials_left(study: Study) -> int:
    """The trials ``study`` may still start: none once its searcher is exhausted, and no
    more than a grid holds (``size``) or ``search.trials`` allows."""
    if study._searcher_exhausted:
        return 0
    size = getattr(study.searcher, "size", None)
    cap = study.spec.search.trials
    if isinstance(size, int) and not isinstance(size, bool):
        cap = min(cap, size)
    return max(0, cap - len(study.trials))


def one_graph_for_every_trial(spec: JobSpec) -> bool:
    """Whether no hyperparameter that shapes the model (anything but a float: sizes,
    choices, the batch size; see :func:`pipetune.engine.known.job_key`) varies between
    trials. System knobs set by the space (``system.<knob>``) do not shape it."""
    for name, dist in spec.hyperparameters.items():
        if name.startswith(SYSTEM_HPARAM_PREFIX) or isinstance(dist, Uniform | LogUniform):
            continue
        if isinstance(dist, Choice):
            values = {repr(v) for v in dist.values}
            if len(values) > 1 and not all(isinstance(v, float) for v in dist.values):
                return False
        elif not isinstance(dist, IntUniform) or dist.low != dist.high:
            return False
    return True
