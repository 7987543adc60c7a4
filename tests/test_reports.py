"""The study's pictures stay bounded: the timeline of a study with more trials than
it draws keeps its size and says what it left out. Its bars are the epochs themselves
(start-up drawn apart), its legend is off the data and its text readable as saved."""

from __future__ import annotations

from known import synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study, run_study_locally
from pipetune.reports import PHASE_COLOURS, TIMELINE_MAX_TRIALS, timeline_figure
from pipetune.spec import JobSpec


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

    from pipetune.engine.study import Trial
    from pipetune.states import Phase
    from pipetune.system.config import SystemConfig

    phases = (Phase.PROFILE, Phase.PROBE, Phase.TRAIN)
    trials = {}
    for trial_id, epochs in enumerate(durations):
        trial = Trial(trial_id=trial_id, params={}, seed=0)
        at = 1_000.0 + trial_id
        for n, seconds in enumerate(epochs, start=1):
            trial.results.append(SimpleNamespace(
                trial_id=trial_id, epoch=n, phase=phases[min(n - 1, 2)], started=at,
                finished=at + seconds, setup_s=0.0, checkpoint_s=0.0, eval_s=0.0,
                measurement=SimpleNamespace(wall_s=seconds),
                system=SystemConfig(cores=1 + n % 2, interop_threads=1 + n % 3)))
            at += seconds
        trials[trial_id] = trial
    return SimpleNamespace(trials=trials, spec=SimpleNamespace(name="bars"), epoch_times={})


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
    bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_gid().startswith("epoch:")]
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


def _tiny_study(tmp_path) -> Study:
    """A real study of 2 trials x 3 epochs of the synthetic workload, run in-process."""
    job = synthetic_job("timeline", trials=2)
    job["profiler"] = {"perf": "off"}
    study = Study(JobSpec.from_dict(job), study_id="timeline",
                  checkpoints=CheckpointStore(tmp_path / "ck"))
    return run_study_locally(study)


def test_timeline_bars_are_the_epochs_and_start_up_is_a_band_before_them(tmp_path):
    """Each epoch's bar is as long as its training and evaluation and ends where they
    ended on its worker; before it, separate bands of other colours: the start-up, from
    hand-out to the workload built and its checkpoint loaded, then the profiler's
    set-up and read-out."""
    from matplotlib.colors import to_hex

    study = _tiny_study(tmp_path)
    fig = timeline_figure(study)
    (ax,) = fig.axes
    patches = {p.get_gid(): p for p in ax.patches}
    results = [r for t in study.trials.values() for r in t.results]
    assert len(results) == 6
    handed = {(r.trial_id, r.epoch): study.epoch_times[(r.trial_id, r.epoch)][1]
              for r in results}
    t0 = min(handed.values())
    ms = 2e-3
    for r in results:
        whose = f"{r.trial_id}:{r.epoch}"
        bar = patches[f"epoch:{whose}"]
        start_up, profiler = patches[f"start-up:{whose}"], patches[f"profiler:{whose}"]
        ready, end = r.started + r.setup_s - t0, r.finished - r.checkpoint_s - t0
        epoch_s = r.measurement.wall_s + r.eval_s
        assert abs(bar.get_width() - epoch_s) < ms, (whose, bar.get_width(), epoch_s)
        assert abs(bar.get_x() + bar.get_width() - end) < ms, (whose, bar.get_x(), end)
        assert bar.get_width() < r.finished - r.started, whose  # the set-up is not in it
        assert handed[(r.trial_id, r.epoch)] <= r.started
        assert abs(start_up.get_x() - (handed[(r.trial_id, r.epoch)] - t0)) < ms, whose
        assert abs(start_up.get_x() + start_up.get_width() - ready) < ms, whose
        assert abs(profiler.get_x() - (start_up.get_x() + start_up.get_width())) < 1e-9
        assert abs(profiler.get_x() + profiler.get_width() - bar.get_x()) < 1e-9, whose
        for band in (start_up, profiler):
            assert band.get_width() > 0 and band.get_y() == bar.get_y(), whose
            assert to_hex(band.get_facecolor()) not in {
                to_hex(c) for c in PHASE_COLOURS.values()}
        assert to_hex(start_up.get_facecolor()) != to_hex(profiler.get_facecolor())
        assert to_hex(bar.get_facecolor()) == PHASE_COLOURS[r.phase.value]


def test_timeline_legend_is_off_the_bars_and_inside_the_picture(tmp_path):
    fig = timeline_figure(_tiny_study(tmp_path))
    fig.canvas.draw()
    (ax,) = fig.axes
    (legend,) = fig.legends or [ax.get_legend()]
    box = legend.get_window_extent()
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1
    assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    texts = " ".join(t.get_text() for t in legend.get_texts())
    assert "start-up" in texts and all(p in texts for p in PHASE_COLOURS)
    assert ax.patches
    for patch in ax.patches:
        bar = patch.get_window_extent()
        overlap_w = min(box.x1, bar.x1) - max(box.x0, bar.x0)
        overlap_h = min(box.y1, bar.y1) - max(box.y0, bar.y0)
        assert overlap_w <= 0 or overlap_h <= 0, (patch.get_gid(), box, bar)


def _cap_height_px(text, dpi: float) -> int:
    """The height in pixels of a capital H in ``text``'s font, rendered at ``dpi``."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1), dpi=dpi)
    fig.text(0.5, 0.5, "H", fontproperties=text.get_fontproperties(), ha="center",
             va="center")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ink = np.nonzero((np.asarray(canvas.buffer_rgba())[..., 0] < 128).any(axis=1))[0]
    return int(ink.max() - ink.min() + 1)


def test_timeline_text_is_readable_as_saved(tmp_path):
    """Every text of the picture (bar labels, ticks, axis label, title, legend) has
    capitals at least 9 pixels tall at the resolution the tracker saves it with."""
    import matplotlib
    from matplotlib.text import Text

    assert matplotlib.rcParams["savefig.dpi"] == "figure"  # as the tracker saves it
    real = timeline_figure(_tiny_study(tmp_path))
    labelled = timeline_figure(_bars_study([[0.5, 30.0], [8.0, 0.2]]))
    for fig in (real, labelled):
        fig.canvas.draw()
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        assert any(t.get_text().startswith("trial") for t in texts)
        assert any("start-up" in t.get_text() for t in texts)
        for text in texts:
            assert _cap_height_px(text, fig.dpi) >= 9, (text.get_text(), text.get_fontsize())
    bar_labels = [t for t in labelled.axes[0].texts if t.get_text().startswith("e")]
    assert len(bar_labels) >= 2
