"""The study's pictures stay bounded: the timeline of a study with more trials than
it draws keeps its size and says what it left out."""

from __future__ import annotations

from known import synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.reports import TIMELINE_MAX_TRIALS, timeline_figure
from pipetune.spec import JobSpec
from pipetune.study import Study, run_study_locally


def _study(tmp_path, trials: int) -> Study:
    job = synthetic_job("many", trials=trials)
    job["workload"]["params"] = {"train_samples": 16, "val_samples": 8}
    job["early_stopping"] = {"policy": "none", "max_epochs": 1}
    job["system"]["space"] = {}
    job["pipetune"] = {"enabled": False}
    # 135 in-process epochs: perf attached to this thread-heavy test process would spend
    # up to seconds detaching from each (its counts are not what this test is about).
    job["profiler"] = {"perf": "off"}
    study = Study(JobSpec.from_dict(job), study_id="many",
                  checkpoints=CheckpointStore(tmp_path / "ck"))
    return run_study_locally(study)


def test_the_timeline_of_many_trials_keeps_its_size(tmp_path):
    few = timeline_figure(_study(tmp_path / "few", TIMELINE_MAX_TRIALS))
    many_study = _study(tmp_path / "many", TIMELINE_MAX_TRIALS + 15)
    many = timeline_figure(many_study)
    assert tuple(many.get_size_inches()) == tuple(few.get_size_inches())
    (ax,) = many.axes
    assert len(ax.get_yticklabels()) == TIMELINE_MAX_TRIALS
    assert f"{TIMELINE_MAX_TRIALS} of {TIMELINE_MAX_TRIALS + 15} trials" in ax.get_title()
    assert "of" not in few.axes[0].get_title().split(":")[-1]


def _bars_study(durations: list[list[float]]):
    """A finished-looking study: per trial, epochs back to back lasting ``durations``."""
    from types import SimpleNamespace

    from pipetune.states import Phase
    from pipetune.study import Trial
    from pipetune.system.config import SystemConfig

    phases = (Phase.PROFILE, Phase.PROBE, Phase.TRAIN)
    trials = {}
    for trial_id, epochs in enumerate(durations):
        trial = Trial(trial_id=trial_id, params={}, seed=0)
        at = 1_000.0 + trial_id
        for n, seconds in enumerate(epochs, start=1):
            trial.results.append(SimpleNamespace(
                epoch=n, phase=phases[min(n - 1, 2)], started=at, finished=at + seconds,
                system=SystemConfig(cores=1 + n % 2, interop_threads=1 + n % 3)))
            at += seconds
        trials[trial_id] = trial
    return SimpleNamespace(trials=trials, spec=SimpleNamespace(name="bars"))


def test_timeline_labels_only_bars_they_fit_and_never_overlap():
    """Many short bars beside a few long ones: a label is drawn only inside a bar wide
    enough for it (as the renderer measures the text), so no two labels overlap."""
    short = [0.04] * 40
    study = _bars_study([[*short, 30.0], [8.0, *short], [0.5, 0.3, 0.2, 15.0], short])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = timeline_figure(study)
    (ax,) = fig.axes
    renderer = FigureCanvasAgg(fig).get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith("e")]
    boxes = [t.get_window_extent(renderer) for t in labels]
    bars = [p.get_window_extent(renderer) for p in ax.patches]
    epochs = sum(len(t.results) for t in study.trials.values())
    assert len(bars) == epochs
    assert 3 <= len(labels) < epochs  # the long bars are labelled, the short ones not
    for i, a in enumerate(boxes):
        assert any(b.x0 <= a.x0 and a.x1 <= b.x1 and b.y0 <= a.y0 and a.y1 <= b.y1
                   for b in bars), labels[i].get_text()
        for b in boxes[i + 1:]:
            overlap_w = min(a.x1, b.x1) - max(a.x0, b.x0)
            overlap_h = min(a.y1, b.y1) - max(a.y0, b.y0)
            assert overlap_w <= 0 or overlap_h <= 0, (labels[i].get_text(), a, b)
