"""What ``pipetune tune`` prints, read as a log (stdout and stderr not a terminal)."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

from pipetune.cli.tune_display import LiveDisplay as _LiveDisplay
from pipetune.cli.tune_display import print_summary as _print_summary
from pipetune.engine.study import Trial


def _study():
    """A study's read-only view, as the engine hands its observers one, over a stand-in
    with what the view reads."""
    from pipetune.engine.view import StudyView

    trial = Trial(trial_id=0, params={"lr": 0.1}, seed=0)
    return StudyView(SimpleNamespace(
        spec=SimpleNamespace(name="log-job", search=SimpleNamespace(trials=1)),
        trials={0: trial}, in_flight=1, max_epochs=3, best_trial=lambda: None,
        metric="accuracy", study_id="log-job-1"))


SUMMARY = {
    "trials_table": [{"trial": 0, "outcome": "completed", "epochs": 3, "probe_epochs": 1,
                      "accuracy": 0.9, "system": "cores=1 interop=1 workers=0", "error": ""}],
    "best_value": 0.9, "best_trial": 0, "best_params": {"lr": 0.1},
    "best_system": "cores=1 interop=1 workers=0", "tuning_wall_s": 1.0, "epochs_run": 3,
    "probe_epochs": 1, "groundtruth_hits": 0, "groundtruth_lookups": 1, "energy_j": 1.0,
    "energy_source": "estimate", "parent_run_id": "abc", "tracking_uri": "sqlite:///m.db",
    "study_id": "s",
}


def test_in_a_log_only_the_final_table_is_printed_its_title_on_its_own_line(monkeypatch):
    """Redirected (``pipetune tune job.yaml > log.txt 2>&1``), the live table goes when
    the study ends, as on a terminal (it was printed once at its end, a stale copy
    of the final table); the final table's title starts on its own line."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    monkeypatch.setattr(sys, "stderr", log)
    display = _LiveDisplay(trials=1, metric="accuracy")
    with display:
        display.update(_study())
    _print_summary(SUMMARY, "accuracy", "http://127.0.0.1:4200/api", None)

    lines = log.getvalue().splitlines()
    assert not any("log-job: 1/1 trials" in line for line in lines), lines
    titles = [line for line in lines if line.strip().endswith("trials")]
    assert [t.strip() for t in titles] == ["trials"], titles


def test_the_table_is_rebuilt_at_most_four_times_a_second_and_the_last_step_is_shown(
        monkeypatch):
    """A long study steps hundreds of times a second; the table (built from every trial)
    is drawn at most every 0.25 s, and the last step is drawn when the display closes."""
    from pipetune.engine.events import Stepped

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    drawn: list[int] = []

    class Counting(_LiveDisplay):
        def update(self, view) -> None:
            drawn.append(view.trials_started)
            super().update(view)

    display = Counting(trials=300, metric="accuracy")
    with display:
        view = _study()
        trials = view._study.trials  # the stand-in's own trials, grown as a study grows
        for i in range(1, 301):  # 300 steps, as fast as the loop can go
            trials[i] = Trial(trial_id=i, params={"lr": 0.1}, seed=i)
            display.observe(Stepped(view=view))
        assert 1 <= len(drawn) <= 3, drawn
    assert drawn[-1] == 301  # closing drew the newest step
