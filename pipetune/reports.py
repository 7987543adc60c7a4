"""What a study did, read off the engine: its summary, the trials table, the timeline
and the orchestration-overhead figures. Nothing here changes the study."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from pipetune.states import TrialState

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from pipetune.engine.study import Study
    from pipetune.system.config import SystemConfig

PHASE_COLOURS = {"profile": "#f2a541", "probe": "#5b8def", "train": "#54b36b"}


@dataclass(frozen=True)
class StudySummary:
    """The headline numbers of a finished (or running) study."""

    trials: int
    completed: int
    stopped: int
    failed: int
    epochs_run: int
    probe_epochs: int
    groundtruth_hits: int
    groundtruth_lookups: int
    best_trial: int | None
    best_value: float | None
    best_params: dict[str, Any] | None
    best_system: SystemConfig | None
    energy_j: float
    energy_source: str
    compute_s: float
    #: Share of the slots' time that held an epoch while trials remained
    #: (:func:`slots_busy`); None before any epoch ran.
    slots_busy: float | None = None

    def to_metrics(self) -> dict[str, float]:
        out = {
            "trials": self.trials,
            "trials_completed": self.completed,
            "trials_stopped": self.stopped,
            "trials_failed": self.failed,
            "epochs_run": self.epochs_run,
            "probe_epochs": self.probe_epochs,
            "groundtruth_hits": self.groundtruth_hits,
            "groundtruth_lookups": self.groundtruth_lookups,
            "energy_j": self.energy_j,
            "epoch_compute_s": self.compute_s,
        }
        if self.slots_busy is not None:
            out["slots_busy"] = self.slots_busy
        if self.best_value is not None:
            out["best_value"] = self.best_value
            out["best_trial"] = self.best_trial
        return {k: float(v) for k, v in out.items()}


def study_summary(study: Study) -> StudySummary:
    """The headline numbers of ``study`` (what :meth:`Study.summary` returns)."""
    trials = list(study.trials.values())
    results = [r for t in trials for r in t.results]
    best = study.best_trial()
    sources = sorted({r.measurement.energy_source for r in results})
    lookups = [t.match for t in trials if t.match is not None]
    return StudySummary(
        trials=len(trials),
        completed=sum(t.state == TrialState.COMPLETE for t in trials),
        stopped=sum(t.state == TrialState.STOPPED for t in trials),
        failed=sum(t.state == TrialState.FAILED for t in trials),
        epochs_run=len(results),
        probe_epochs=sum(t.probe_epochs for t in trials),
        groundtruth_hits=sum(1 for m in lookups if m.hit),
        groundtruth_lookups=len(lookups),
        best_trial=best.trial_id if best else None,
        best_value=best.last_value(study.metric) if best else None,
        best_params=dict(best.params) if best else None,
        best_system=best.final_system if best else None,
        energy_j=sum(r.measurement.energy_j for r in results),
        energy_source="+".join(sources) if sources else "none",
        compute_s=sum(r.measurement.wall_s for r in results),
        slots_busy=slots_busy(study),
    )


def slots_busy(study: Study) -> float | None:
    """The share of the study's slots (its core budget) that held an epoch, from the
    first epoch sent to the start of the tail: the first trial end after the last
    trial started, when slots free up with nothing left to fill them (ASHA's tail,
    fewer trials than slots). An epoch holds its config's cores from the moment its
    worker takes it to the moment it is done (build, training, evaluation,
    checkpoint); what the slots wait for around it (the worker's start-up, the
    result's way back, the driver's decision, the next send) is idle. None before any
    epoch of this run finished; the same epochs' share of the whole span when the
    study ended before a tail could start."""
    sent = [t[1] for t in study.epoch_times.values() if math.isfinite(t[1])]
    results = [r for t in study.trials.values() for r in t.results]
    if not sent or not results:
        return None
    start = min(sent)
    last_start = max((t.started for t in study.trials.values() if t.started is not None),
                     default=start)
    ends = [t.ended for t in study.trials.values()
            if t.ended is not None and t.ended >= last_start]
    end = min(ends) if ends else max(r.finished for r in results)
    if end <= start:
        end = max(r.finished for r in results)
    if end <= start:
        return None
    held = sum(r.system.cores * max(0.0, min(r.finished, end) - max(r.started, start))
               for r in results)
    return min(1.0, held / (study.core_budget * (end - start)))


def load_in_background() -> None:
    """Import what the study's end draws with (matplotlib, pandas) in a daemon thread,
    while the study trains: the end of a study then spends its time writing, not
    importing (0.3-0.8 s of the command's shut-down here)."""
    import threading

    def load() -> None:
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.figure  # noqa: F401
            import matplotlib.patches  # noqa: F401
            import pandas  # noqa: F401
        except Exception:  # noqa: BLE001 - loaded again, and failing there, when drawn
            pass

    threading.Thread(target=load, name="pipetune-load-reports", daemon=True).start()


def trials_table(study: Study) -> pd.DataFrame:
    """One row per trial: params, outcome, epochs, probes, ground-truth answer, final metric."""
    import pandas as pd

    metric = study.metric
    rows = []
    for t in sorted(study.trials.values(), key=lambda t: t.trial_id):
        rows.append({
            "trial": t.trial_id,
            **{f"hp.{k}": v for k, v in sorted(t.params.items())},
            "outcome": t.state,
            "epochs": t.epochs_run,
            "probe_epochs": t.probe_epochs,
            "groundtruth": ("hit" if t.match.hit else "miss") if t.match else "",
            "final_system": t.final_system.label() if t.final_system else "",
            metric: t.last_value(metric),
            "epoch_s_total": sum(r.measurement.wall_s for r in t.results),
            "energy_j": sum(r.measurement.energy_j for r in t.results),
            "error": t.error or "",
        })
    return pd.DataFrame(rows)


#: The timeline draws at most this many trials, so its size is bounded however many
#: trials a study has (a :data:`TIMELINE_ROW_IN` row each).
TIMELINE_MAX_TRIALS = 60
#: The picture's resolution (as saved), width and height per trial row, in inches.
TIMELINE_DPI = 100
TIMELINE_WIDTH_IN = 12.0
TIMELINE_ROW_IN = 0.75
#: Point size of every text on the timeline: at :data:`TIMELINE_DPI` a capital letter
#: is 10 pixels tall (9.5 pt renders 8 px tall capitals).
TIMELINE_FONT_PT = 10.0
#: What is drawn around an epoch but is not the epoch: its start-up (from hand-out to
#: the worker's start, the worker building the workload and loading its checkpoint),
#: the profiler's own set-up and read-out with the system config's application, and
#: saving the checkpoint.
STARTUP_COLOUR = "#dcdcdc"
PROFILER_COLOUR = "#c8b4e0"
SAVE_COLOUR = "#8c8c8c"


class EpochSpan(NamedTuple):
    """Where one epoch's time went, as wall-clock times (``time.time()``)."""

    #: Handed out by the study (the worker's start where the study has no hand-out
    #: time, or where the two machines' clocks put the hand-out after it).
    handed: float
    #: On the worker: the workload built and its checkpoint loaded.
    ready: float
    #: ``ended`` less the training's and the evaluation's seconds: the epoch proper.
    #: Between ``ready`` and here: the profiler's set-up and read-out (the read-out
    #: really falls between training and evaluation) and the config's application.
    began: float
    #: Trained and evaluated.
    ended: float
    #: Its checkpoint saved (handed to the background writer, for a live trial).
    saved: float


def epoch_span(study: Study, result: Any) -> EpochSpan:
    """Where ``result``'s epoch spent its time, from the study's hand-out to its save."""
    times = study.epoch_times.get((result.trial_id, result.epoch))
    handed = times[1] if times is not None and math.isfinite(times[1]) else result.started
    ready = result.started + result.setup_s
    ended = max(result.finished - result.checkpoint_s, ready)
    began = max(ended - result.measurement.wall_s - result.eval_s, ready)
    return EpochSpan(min(handed, result.started), ready, began, ended,
                     max(result.finished, ended))


def timeline_figure(study: Study) -> Figure:
    """Trials by wall-clock time. Per epoch, a bar as long as its training and
    evaluation, ending where they ended on its worker, coloured by phase and labelled,
    where the text fits inside the bar, with its epoch and system config (or its epoch
    alone); before it two bands, the start-up (handed out -> worker started ->
    workload built and checkpoint loaded) and the profiler's set-up and read-out; after
    it a sliver, the checkpoint save (see :class:`EpochSpan`). Each patch's gid says
    what it is (``epoch``, ``start-up``, ``profiler``, ``save``) and whose:
    ``epoch:<trial>:<epoch>``. Past :data:`TIMELINE_MAX_TRIALS` trials, the ones that
    ran the most epochs are drawn (the title says how many of how many)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    trials = sorted(study.trials.values(), key=lambda t: t.trial_id)
    total = len(trials)
    if total > TIMELINE_MAX_TRIALS:
        longest = sorted(trials, key=lambda t: (-t.epochs_run, t.trial_id))
        trials = sorted(longest[:TIMELINE_MAX_TRIALS], key=lambda t: t.trial_id)
    spans = {(t.trial_id, r.epoch): epoch_span(study, r) for t in trials for r in t.results}
    t0 = min((s.handed for s in spans.values()), default=0.0)
    fig = Figure(figsize=(TIMELINE_WIDTH_IN, TIMELINE_ROW_IN * max(len(trials), 2) + 2.4),
                 dpi=TIMELINE_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    font = TIMELINE_FONT_PT
    labels = _draw_epochs(ax, trials, spans, t0, font)
    ax.set_yticks(range(len(trials)), [f"trial {t.trial_id} ({t.state})" for t in trials])
    ax.set_ylim(max(len(trials), 1) - 0.5, -0.5)  # trial 0 on top
    ax.tick_params(labelsize=font)
    ax.set_xlabel("seconds since the first epoch was handed out", fontsize=font)
    shown = f" ({len(trials)} of {total} trials: those that ran longest)" \
        if len(trials) < total else ""
    ax.set_title(f"{study.spec.name}: epochs by phase and system config{shown}",
                 fontsize=font + 2)
    # Two rows: the phases (the epochs), then what is not the epoch.
    handles = [
        Patch(color=PHASE_COLOURS["profile"], label="profile epoch"),
        Patch(color=STARTUP_COLOUR, label="start-up: handed out → worker, build, load"),
        Patch(color=PHASE_COLOURS["probe"], label="probe epoch"),
        Patch(color=PROFILER_COLOUR, label="profiler set-up + read-out"),
        Patch(color=PHASE_COLOURS["train"], label="train epoch"),
        Patch(color=SAVE_COLOUR, label="checkpoint save"),
    ]
    legend = fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0),
                        ncols=3, fontsize=font, title_fontsize=font, frameon=False,
                        title="bars: each epoch's training + evaluation on its worker, "
                              "by phase; bands before a bar: its start-up, then the "
                              "profiler's set-up + read-out")
    # The legend sits under the axes, off the data: the layout keeps its height free.
    height = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.bbox.height
    fig.tight_layout(rect=(0, height, 1, 1))
    _label_bars(fig, ax, labels)
    return fig


#: Bar height in rows; the room (points) a label keeps from its bar's edges; the width
#: (points) under which a bar loses its outline, which would hide its colour.
BAR_HEIGHT = 0.6
LABEL_MARGIN_PT = 1.5
OUTLINE_MIN_PT = 3.0


def _draw_epochs(ax: Any, trials: list[Any], spans: dict[tuple[int, int], Any], t0: float,
                 font: float) -> list[tuple[Any, list[str]]]:
    """Each trial's row of :func:`timeline_figure`: its epochs' bars and bands, and a
    failed trial's mark; the epoch bars with their candidate labels."""
    from matplotlib.patches import Rectangle

    # (row, left, width, colour, gid) per kind, each bar added as a plain rectangle kept
    # out of the layout's measure, the limits set once (a barh call per bar, measured by
    # the layout, took 3.3 s for 480 epochs; one barh per kind 1.4 s).
    bands: dict[str, list[tuple[int, float, float, str, str]]] = {
        "start-up": [], "profiler": [], "save": [], "epoch": []}
    texts: list[list[str]] = []
    for row, t in enumerate(trials):
        last = 0.0
        for r in t.results:
            handed, ready, began, ended, saved = (s - t0 for s in spans[(t.trial_id, r.epoch)])
            whose = f"{t.trial_id}:{r.epoch}"
            for kind, left, right, colour in (("start-up", handed, ready, STARTUP_COLOUR),
                                              ("profiler", ready, began, PROFILER_COLOUR),
                                              ("save", ended, saved, SAVE_COLOUR)):
                if right > left:
                    bands[kind].append((row, left, right - left, colour, f"{kind}:{whose}"))
            bands["epoch"].append((row, began, max(ended - began, 1e-3),
                                   PHASE_COLOURS[r.phase.value], f"epoch:{whose}"))
            texts.append([f"e{r.epoch}\n{r.system.label()}", f"e{r.epoch}"])
            last = max(last, saved)
        if t.state == TrialState.FAILED:
            ax.text(last, row, " failed", fontsize=font, color="red", va="center")
    drawn: dict[str, list[Any]] = {kind: [] for kind in bands}
    for kind, bars in bands.items():
        outline = {"edgecolor": "black", "linewidth": 0.4} if kind == "epoch" else \
            {"linewidth": 0}
        for row, left, width, colour, gid in bars:
            rect = Rectangle((left, row - BAR_HEIGHT / 2), width, BAR_HEIGHT,
                             facecolor=colour, gid=gid, **outline)
            rect.set_in_layout(False)
            drawn[kind].append(ax.add_artist(rect))
    edges = [(left, row) for bars in bands.values() for row, left, width, _, _ in bars] + \
        [(left + width, row) for bars in bands.values() for row, left, width, _, _ in bars]
    if edges:
        ax.update_datalim(edges)
        ax.autoscale_view()
    return list(zip(drawn["epoch"], texts, strict=True))


def _label_bars(fig: Figure, ax: Any, labels: list[tuple[Any, list[str]]]) -> None:
    """Write in each bar the first of its labels (longest first) that fits in the bar
    as drawn, the text as the renderer measures it; leave a bar too narrow (or too
    short) for all of them unlabelled, its colour still saying the phase. Called once
    the layout is final."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    renderer = canvas.get_renderer()
    ax.get_xlim()  # settles the autoscaled view limits that transData maps through
    points = fig.dpi / 72
    room = 2 * LABEL_MARGIN_PT * points
    for bar, texts in labels:
        box = bar.get_window_extent(renderer)
        if box.width < OUTLINE_MIN_PT * points:
            bar.set_linewidth(0)
        for text in texts:
            label = ax.text(bar.get_x() + bar.get_width() / 2,
                            bar.get_y() + bar.get_height() / 2, text, ha="center",
                            va="center", fontsize=TIMELINE_FONT_PT)
            extent = label.get_window_extent(renderer)
            if extent.width + room <= box.width and extent.height + room <= box.height:
                break
            label.remove()


def orchestration_overhead(study: Study) -> list[dict[str, float]]:
    """Per epoch: where the time around its own compute went.

    ``round_trip_s``: handed to the executor -> result back in the loop, minus the
    time the worker spent on the epoch (task submission, scheduling, state updates,
    result transfer). ``worker_extra_s``: model rebuild + checkpoint load, and the
    checkpoint snapshot (its write is in the background). ``build_s`` (not overhead):
    the workload's constructor, i.e. loading its data, once per worker process.
    ``loop_gap_s``: result back -> the trial's next epoch ready (ground-truth lookup,
    tuning decision, tracking). ``compute_s``: training + evaluation. ``core_wait_s``
    (not overhead): ready -> handed out, waiting for the cores its config reserves.
    """
    rows = []
    for trial in study.trials.values():
        for i, r in enumerate(trial.results):
            ready, handed, back = study.epoch_times.get(
                (r.trial_id, r.epoch), (math.nan, math.nan, math.nan))
            nxt = study.epoch_times.get((r.trial_id, r.epoch + 1))
            worker_s = r.finished - r.started
            rows.append({
                "trial": r.trial_id,
                "epoch": r.epoch,
                "compute_s": r.measurement.wall_s + r.eval_s,
                "round_trip_s": (back - handed) - worker_s,
                "worker_extra_s": r.setup_s - r.build_s + r.checkpoint_s,
                "build_s": r.build_s,
                "loop_gap_s": (nxt[0] - back) if nxt and i + 1 < len(trial.results) else 0.0,
                "core_wait_s": handed - ready,
            })
    for row in rows:
        row["overhead_s"] = row["round_trip_s"] + row["worker_extra_s"] + row["loop_gap_s"]
    return rows


def overhead_summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians per epoch and the overhead's share of the epochs' critical path:
    ``sum(overhead) / sum(overhead + compute)``."""
    if not rows:
        return {}
    overhead = sum(r["overhead_s"] for r in rows)
    compute = sum(r["compute_s"] for r in rows)
    out = {
        f"orchestration_{key}_median": statistics.median(r[key] for r in rows)
        for key in ("overhead_s", "round_trip_s", "worker_extra_s", "loop_gap_s", "core_wait_s")
    }
    out["orchestration_share"] = overhead / (overhead + compute) if overhead + compute else 0.0
    return out
