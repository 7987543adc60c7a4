"""What ``pipetune tune`` draws: the live table of trials while the study runs, and the
summary it prints at the end (the final table, the best trial, where the records are)."""

from __future__ import annotations

import math
import time


class LiveDisplay:
    """A live table of trials: epochs, phase, system config, metric, best so far."""

    def __init__(self, trials: int, metric: str):
        self.trials = trials
        self.metric = metric
        self._live = None
        self._last = -math.inf
        self._shown = False
        #: A study whose newest step is not drawn yet (drawn at most every
        #: :attr:`EVERY_S`: the table is rebuilt from every trial, which cost a long
        #: study's loop ~5% of its time when drawn at each of its steps).
        self._pending = None

    #: The terminal shows the table 4 times a second; building it more often is waste.
    EVERY_S = 0.25

    def __enter__(self):
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        # Gone when the study ends: the trials table printed then says it all, once.
        self._live = Live(console=console, refresh_per_second=4, transient=True)
        self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            if self._pending is not None:  # the last step's table, not one 0.25 s older
                self.update(self._pending)
            self._live.__exit__(*exc)
            if self._shown and not self._live.console.is_terminal:
                # Into a log (not a terminal) rich prints the last table without ending
                # its last line: end it, as rich does on a terminal, so what is printed
                # next (the final table's title) starts on a line of its own.
                self._live.console.line()

    def observe(self, event) -> None:
        """A study observer (:mod:`pipetune.engine.events`): redraw after a step, at most every
        :attr:`EVERY_S` (the last step is drawn when the display closes)."""
        from pipetune.engine.events import Stepped

        if not isinstance(event, Stepped):
            return
        if time.monotonic() - self._last < self.EVERY_S:
            self._pending = event.view
            return
        self.update(event.view)


    def update(self, view) -> None:
        """Draw the table from ``view`` (a :class:`~pipetune.engine.view.StudyView`)."""
        if self._live is None:
            return
        from rich.table import Table

        best = view.best()
        best_txt = (f"{self.metric}={best.value:.4f} (trial {best.trial_id})"
                    if best is not None and best.value is not None else "-")
        table = Table(title=f"{view.name}: {view.trials_started}/{self.trials} trials, "
                            f"{view.in_flight} epochs running, best {best_txt}")
        for col in ("trial", "state", "epochs", "last phase", "system", self.metric):
            table.add_column(col)
        for t in view.trials(last=12):
            table.add_row(
                str(t.trial_id), t.state, f"{t.epochs_run}/{view.max_epochs}",
                t.last_phase or "-", t.last_system or "-",
                f"{t.value:.4f}" if t.value is not None else "-",
            )
        self._live.update(table)
        self._shown = True
        self._last = time.monotonic()
        self._pending = None


#: Rows of the end-of-study trials table at most: past it, the best trials and the failed
#: ones are shown (trials.csv on the study's MLflow run has every trial), as Ray Tune's
#: status table does.
SUMMARY_ROWS = 30


def summary_rows(rows: list[dict], metric: str, mode: str = "max") -> list[dict]:
    """The rows of the trials table to print: all of them up to :data:`SUMMARY_ROWS`;
    past it, the failed ones (up to a third of the table) and the best by ``metric``,
    in trial order."""
    if len(rows) <= SUMMARY_ROWS:
        return rows
    failed = [r for r in rows if r["outcome"] == "failed"][:SUMMARY_ROWS // 3]
    scored = [r for r in rows if r.get(metric) is not None and r not in failed]
    scored.sort(key=lambda r: r[metric], reverse=mode == "max")
    keep = {id(r) for r in (*failed, *scored[:SUMMARY_ROWS - len(failed)])}
    return [r for r in rows if id(r) in keep]


def print_summary(summary: dict, metric: str, api_url: str, server, warm=None, *,
                  mode: str = "max") -> None:
    import shlex

    from rich.console import Console
    from rich.table import Table

    from pipetune.tracking import default_tracking_uri
    from pipetune.tracking.links import run_url, study_runs_url, ui_base_url

    console = Console()
    table = Table(title="trials")
    for col in ("trial", "outcome", "epochs", "probes", metric, "system", "error"):
        table.add_column(col)
    shown = summary_rows(summary["trials_table"], metric, mode)
    for row in shown:
        value = row.get(metric)
        table.add_row(str(row["trial"]), row["outcome"], str(row["epochs"]),
                      str(row["probe_epochs"]), f"{value:.4f}" if value is not None else "-",
                      row["system"], error_cell(row))
    if len(shown) < len(summary["trials_table"]):
        table.caption = (f"the best {len(shown)} of {len(summary['trials_table'])} trials (and "
                         "any that failed); every trial: trials.csv on the study's MLflow run")
    console.print(table)
    best = summary.get("best_value")
    # Plain prints: ids and paths must not be wrapped or read as markup.
    print(f"best {metric}: {best:.4f} (trial {int(summary['best_trial'])}) params "
          f"{summary['best_params']} system: {summary['best_system']}"
          if best is not None else "no trial finished")
    print(f"tuning wall time {summary['tuning_wall_s']:.1f} s | epochs "
          f"{int(summary['epochs_run'])} | probe epochs {int(summary['probe_epochs'])} | "
          f"ground-truth hits {int(summary['groundtruth_hits'])}/"
          f"{int(summary['groundtruth_lookups'])} | energy {summary['energy_j']:.1f} J "
          f"({summary['energy_source']})" + (
              f" | slots busy {summary['slots_busy']:.0%}" if "slots_busy" in summary else ""))
    if summary.get("resumed_epochs"):
        print(f"resumed study {summary['study_id']}: {int(summary['resumed_epochs'])} finished "
              "epochs taken over, not run again")
    uri, run_id = summary["tracking_uri"], summary["parent_run_id"]
    print(f"MLflow: run {run_id} in {uri}")
    base, experiment_id = ui_base_url(uri), summary.get("experiment_id")
    link = (study_runs_url(base, experiment_id, summary["study_id"])
            if experiment_id and summary.get("study_id") else run_url(base, run_id, experiment_id))
    served = uri.split(":", 1)[0].lower() in ("http", "https")  # the server shows it
    ui = "pipetune ui" + ("" if uri == default_tracking_uri()
                          else f" --tracking-uri {shlex.quote(uri)}")
    print(f"  open {link}" + ("" if served else f" (start the UI first: {ui})"))
    if server is None:
        print(f"Prefect: flow runs at {api_url.removesuffix('/api')}" + (
            "" if warm is None else f" (served {warm.idle_s / 60:g} min after the last "
            "command; `pipetune service stop` ends it)"))


def error_cell(row: dict) -> str:
    """A failed trial's error in the table: whole (rich wraps it), or, when its traceback
    was kept, the exception's first line and the file that has the rest."""
    error, where = row.get("error", ""), row.get("traceback", "")
    if not where:
        return error
    first = error.split(": ", 1)[0] if ": " in error else error
    return f"{first}, see {where}"
