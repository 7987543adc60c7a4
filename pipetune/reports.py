"""Tables and pictures of a study: the trials table and the timeline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipetune.states import TrialState

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from pipetune.study import Study

PHASE_COLOURS = {"profile": "#f2a541", "probe": "#5b8def", "train": "#54b36b"}


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
#: trials a study has (a 0.6-inch row each).
TIMELINE_MAX_TRIALS = 60


def timeline_figure(study: Study) -> Figure:
    """Trials by wall-clock time, one bar per epoch coloured by phase and labelled
    with its system config. Past :data:`TIMELINE_MAX_TRIALS` trials, the ones that
    ran the most epochs are drawn (the title says how many of how many)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    trials = sorted(study.trials.values(), key=lambda t: t.trial_id)
    total = len(trials)
    if total > TIMELINE_MAX_TRIALS:
        longest = sorted(trials, key=lambda t: (-t.epochs_run, t.trial_id))
        trials = sorted(longest[:TIMELINE_MAX_TRIALS], key=lambda t: t.trial_id)
    starts = [r.started for t in trials for r in t.results]
    t0 = min(starts) if starts else 0.0
    fig = Figure(figsize=(11, 0.6 * max(len(trials), 2) + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    for row, t in enumerate(trials):
        for r in t.results:
            left, width = r.started - t0, max(r.finished - r.started, 1e-3)
            ax.barh(row, width, left=left, height=0.6,
                    color=PHASE_COLOURS[r.phase.value], edgecolor="black", linewidth=0.4)
            ax.text(left + width / 2, row, f"e{r.epoch}\n{r.system.label()}",
                    ha="center", va="center", fontsize=5.5)
        if t.state == TrialState.FAILED:
            ax.text(0, row + 0.35, "failed", fontsize=6, color="red")
    ax.set_yticks(range(len(trials)), [f"trial {t.trial_id} ({t.state})" for t in trials])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first epoch started")
    shown = f" ({len(trials)} of {total} trials: those that ran longest)" \
        if len(trials) < total else ""
    ax.set_title(f"{study.spec.name}: epochs by phase and system config{shown}")
    ax.legend(handles=[Patch(color=c, label=p) for p, c in PHASE_COLOURS.items()],
              loc="lower right", fontsize=7)
    fig.tight_layout()
    return fig
