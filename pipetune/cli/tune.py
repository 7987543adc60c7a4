"""``pipetune tune``.

The CLI is the one place in ``pipetune/`` that may reach Prefect, and only lazily:
``tune`` imports ``flows.study`` after the job file has been validated and the local
Prefect server (if any) is up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
from pathlib import Path

from pipetune.cli import quiet_defaults
from pipetune.cli.tune_display import LiveDisplay, print_summary
from pipetune.cli.tune_startup import _KEEP_WARM_HINT, BackgroundStartup, Startup
from pipetune.errors import SpecError, Stopped


def _check_options(args: argparse.Namespace) -> None:
    if args.trials is not None and args.trials < 1:
        raise SpecError("--trials", f"must be an integer >= 1, got {args.trials}")
    from pipetune.dask.address import check_scheduler_address, client_security, default_address

    args.dask_address = args.dask_address or default_address()
    if args.dask_address:
        check_scheduler_address(args.dask_address, allow_insecure=args.allow_insecure_dask)
        client_security()  # a half-set or missing TLS file is refused now, by name
    if args.dask_address and (args.workers or args.cores_per_worker):
        option = "--workers" if args.workers else "--cores-per-worker"
        raise SpecError(option, "sizes the embedded cluster: not with --dask-address "
                        "(size that cluster's workers where it is started)")
    from pipetune.dask.size import size_embedded_cluster

    if not args.dask_address:  # also what a warm service started now is keyed by
        size_embedded_cluster(args.workers, args.cores_per_worker)
    if args.tracking_uri and not re.match(r"^(sqlite|file|https?|postgresql|mysql|databricks)",
                                          args.tracking_uri):
        raise SpecError(
            "--tracking-uri",
            "must be an MLflow tracking URI (sqlite:///path.db, http://host:port, file:///dir, ...)"
            f", got {args.tracking_uri!r}",
        )


def run_tune(args: argparse.Namespace) -> int:
    with _stop_on_signals():
        return _run_tune(args)


def _job_after_resume(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``pipetune tune --resume JOB.yaml``: ``--resume`` takes an optional study id, so
    the job file written after it arrives as that id. A job file there is the job, and
    the newest unfinished study of it is resumed. No job file at all is refused."""
    if args.job is not None:
        return
    named = args.resume if args.resume not in (None, "latest") else None
    if named is not None and (Path(named).suffix.lower() in JOB_SUFFIXES
                              or Path(named).is_file()):
        args.job, args.resume = named, "latest"
        return
    parser.error("the following arguments are required: JOB.yaml (e.g. `pipetune tune "
                 "job.yaml`, or `pipetune tune job.yaml --resume`)")


#: What a job file's name ends with (``load_spec`` reads YAML and JSON).
JOB_SUFFIXES = (".yaml", ".yml", ".json")


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM and SIGHUP stop ``tune`` as Ctrl-C does: raised in the main thread as
    :class:`Stopped`, so running epochs are cancelled, MLflow runs end KILLED and the
    server and cluster are stopped on the way out."""
    def stop(signum, _frame):
        for s in previous:  # once: a second signal must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, object] = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        previous[s] = signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_tune(args: argparse.Namespace) -> int:
    def report(summary: dict, spec, server, warm) -> None:
        print_summary(summary, spec.objective.metric, os.environ["PREFECT_API_URL"], server,
                      warm, mode=spec.objective.mode)

    tuned = tune_study(args, display=LiveDisplay, report=report)
    print(tuned.marks.line())
    summary = tuned.summary
    return 0 if summary.get("trials_failed", 0) < summary.get("trials", 0) else 1


class Tuned:
    """What :func:`tune_study` ran: the summary, the study as it ended (its trials and
    their epochs), its flow run's id where Prefect has it, and the start-up marks."""

    def __init__(self, summary: dict, started, marks: Startup, prefect_ui: str = "") -> None:
        self.summary, self.marks = summary, marks
        self.study = started.opened.study
        self.flow_run_id: str | None = started.flow_run_id
        #: The Prefect UI that keeps serving the flow run ("": it stopped with the study).
        self.prefect_ui = prefect_ui


def tune_study(args: argparse.Namespace, *, display, report=None) -> Tuned:
    """Tune ``args.job`` (a job file's path, or a checked
    :class:`~pipetune.spec.JobSpec`) as ``pipetune tune`` does: on the embedded default
    or what ``args`` names, the study trained first and its Prefect flow run and MLflow
    run beside it. ``display(trials, metric)`` is the context that draws its progress
    (its ``observe`` hears the study's events); ``report(summary, spec, server, warm)``
    runs once it is done, while the local Prefect server still serves. Raises what
    stopped it (:class:`~pipetune.errors.PipetuneError`: one line)."""
    from pipetune.home import pipetune_home
    from pipetune.prefect_server import prefect_api

    startup_marks = Startup()
    _check_options(args)
    quiet_defaults()
    _skip_final_collections()
    # Training first (flows.first): the embedded cluster's fork server starts importing
    # torch now; the local Prefect server is launched and the job checked while it does
    # (a bad job stops it again: exit 2, nothing recorded); then the cluster and the
    # study, whose first epoch goes out before Prefect or MLflow answer. The Prefect
    # server's boot, the flow run and the MLflow run come up beside the training.
    warm = _attach_service(args)
    if not args.dask_address and warm is None:
        from pipetune.dask.cluster import launch_forkserver

        launch_forkserver()
    startup = BackgroundStartup(args, startup_marks, warm)
    server = None
    try:
        with prefect_api(pipetune_home() / "prefect-server.log", before_wait=startup.check_job,
                         on_exit=startup.close_cluster, wait=False, launch=False) as server:
            if server is not None:
                server.on_lost = _quiet_lost_server
                server.on_restarted = _say_restarted
            summary, started = _train_first(args, startup, server, display)
            startup_marks.mark("tuning started", summary["started_at"])
            startup_marks.mark("first epoch", summary["first_epoch_at"])
            startup_marks.mark("study done", summary["started_at"] + summary["tuning_wall_s"])
            if report is not None:
                report(summary, startup.spec, server, warm)
            ui = "" if server is not None else \
                os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
    finally:
        startup.close_cluster()
        startup.join_closing()
        if warm is not None:
            warm.release()
            if warm.started_here and startup.spec is None:  # the job was refused: not kept
                warm.stop()
        if server is not None and (server.restarted or server.lost_code is not None):
            # Prefect's calls that failed while its server was down leave exceptions in
            # reference cycles that hold the study's Dask client and cluster: collected
            # now, not at exit (where the cycle collector is off, see
            # _skip_final_collections, and Dask's __del__ then prints "Exception ignored").
            import gc

            gc.collect()
    startup_marks.mark("servers stopped")
    return Tuned(summary, started, startup_marks, ui)


def _attach_service(args: argparse.Namespace):
    """The warm local service (:mod:`pipetune.service`) this command uses, started if
    none serves it; None where the user named a Prefect API or a Dask cluster, or keeps
    nothing warm (``--keep-warm 0``)."""
    from pipetune.service import attach, keep_warm_s

    seconds = keep_warm_s(args.keep_warm)
    if args.dask_address or os.environ.get("PREFECT_API_URL") or seconds == 0:
        return None
    warm = attach(seconds)
    if warm is None:
        return None
    os.environ["PREFECT_API_URL"] = warm.api_url
    # Its server outlives this command: the task-run record ends once it has taken every
    # event, not once it has stored them (tasks.task_run_sink.TaskRunSink).
    os.environ["PIPETUNE_PREFECT_TRUST_TAKEN"] = "1"
    # Its spare recorder, imports done and store open, if one waits (pipetune.sidecar.spare).
    os.environ["PIPETUNE_SPARE_RECORDER"] = str(warm.folder / "recorder.sock")
    if warm.started_here:
        print(f"starting a local Prefect server and Dask cluster, kept warm for "
              f"{seconds / 60:g} min after the last command (`pipetune service stop` ends "
              f"them; {_KEEP_WARM_HINT}) ...", file=sys.stderr, flush=True)
    return warm


def _study_log(console):
    """The study's log in this process: its notices as the command's ``warning:`` lines,
    every line kept for the flow run's log (said there once the run exists)."""
    import logging

    from flows.first import LinesForTheFlowRun
    from pipetune.cli._console import NoticeHandler

    log = logging.getLogger("pipetune.study.tune")
    log.setLevel(logging.INFO)
    log.propagate = False
    for handler in list(log.handlers):
        log.removeHandler(handler)
    lines = LinesForTheFlowRun()
    log.addHandler(lines)
    log.addHandler(NoticeHandler(console))
    return log, lines


def _train_first(args: argparse.Namespace, startup: BackgroundStartup, server,
                 display_for) -> tuple[dict, object]:
    """The cluster, the study opened and trained here under the live table, its flow run
    created beside it (:mod:`flows.first`); the study's summary. A study that finished
    is a success even if its flow run could not be recorded (the Prefect API never
    answered, or stopped): one ``warning:`` line says what Prefect lacks, after the
    training. Returns the summary and the started study."""
    from flows.beside import flow_beside
    from flows.first import StartedStudy
    from pipetune.cli._console import FlowConsole, quiet_flow_tracebacks
    from pipetune.engine.events import EpochSent, StudyFinished
    from pipetune.session import StudyOptions, observing, open_study
    spec = startup.spec
    marks = startup.marks
    # A local store (SQLite: 4-8 s to create) opens the study's MLflow run beside the
    # training. A tracking server opens it before (its run must exist for the spool to
    # keep a server lost mid-study; one not there stops the command before it trains),
    # its MLflow import in the recorder overlapping the cluster's start.
    remote = startup.tracking_uri.lower().startswith(("http://", "https://"))
    opening = None
    if remote:
        from pipetune.tracking import ensure_experiment_in_recorder

        opening = _InBackground(ensure_experiment_in_recorder, startup.tracking_uri)
    startup.start_cluster()
    if opening is not None:
        opening.result()
        marks.mark("MLflow store ready")
    console = FlowConsole()
    log, lines = _study_log(console)
    opened = open_study(spec, StudyOptions(
        tracking_uri=startup.tracking_uri, checkpoint_root=args.checkpoints,
        core_budget=startup.core_budget, dask_address=args.dask_address, resume=args.resume,
        keep_checkpoints=args.keep_checkpoints, start_first=not remote), log=log)
    marks.mark("study opened")
    started = StartedStudy(opened, lines=lines.lines)

    def wait_api() -> None:
        if server is not None:
            server.launch_once().wait_healthy()
            marks.mark("Prefect server ready")
        elif startup.warm is not None:
            startup.warm.wait_prefect()
            marks.mark("Prefect server ready")

    def launch_records(event) -> None:
        # The first epoch is out: the Prefect server boots now, beside the training,
        # not before it, on the CPU the cluster's start needed. (The MLflow store and
        # run come up in the recorder process, which open_study started.)
        if isinstance(event, EpochSent) and server is not None:
            server.launch_once()

    witness = flow_beside(
        started, wait_api, own_server=server is not None or startup.warm is not None,
        around=quiet_flow_tracebacks,
        job=spec, tracking_uri=startup.tracking_uri, checkpoint_root=args.checkpoints,
        keep_checkpoints=args.keep_checkpoints, core_budget=startup.core_budget,
        dask_address=args.dask_address, resume=args.resume)
    display = display_for(spec.search.trials, spec.objective.metric)

    def on_finish(event) -> None:
        if isinstance(event, StudyFinished):
            console.study_finished = True

    try:
        with display, observing(display.observe), observing(on_finish), \
                observing(launch_records):
            summary = started.run()
    finally:  # a study that failed or was stopped does not wait long for its record
        witness.join(_FLOW_RUN_END_S if started.summary is not None else 5.0)
        marks.mark("flow ended")
    if witness.is_alive() or witness.error is not None:
        _say_flow_run_lost(witness, server, console.notices)
    return summary, started


#: How long the command waits, once the study is done, for its flow run to be recorded
#: (the Prefect server still booting, the task runs catching up) before it says what
#: Prefect lacks and exits.
_FLOW_RUN_END_S = float(os.environ.get("PIPETUNE_FLOW_RUN_END_S") or 60)


def _say_flow_run_lost(witness, server, notices: list[str]) -> None:
    """One ``warning:`` line: the study finished (MLflow has all of it) but its flow run
    is not (all) in Prefect."""
    if any("Prefect" in notice for notice in notices):
        return
    lost = "" if server is None or server.lost_code is None else \
        f" (the local Prefect server exited with code {server.lost_code})"
    why = ("it did not answer in time" if witness.is_alive() else
           f"{type(witness.error).__name__}: {witness.error}")
    print(f"warning: the study's flow run is not recorded in the Prefect API at "
          f"{os.environ.get('PREFECT_API_URL', '?')}{lost}: {why}; the study finished and "
          "MLflow has all of it", file=sys.stderr, flush=True)


def _say_restarted(code: int) -> None:
    """One `warning:` line: the embedded Prefect server died mid-study and serves again."""
    print(f"warning: the local Prefect server exited with code {code}; it was started "
          "again on the same port and database, and the study's Prefect record catches "
          "up", file=sys.stderr, flush=True)


def _quiet_lost_server(code: int) -> None:
    """The embedded Prefect server died mid-study (until it serves again): Prefect's log
    shipper would print "--- Error logging to API ---" for every batch it can no longer
    send. Those reports go through logging's error hook; the study says it once."""
    import logging

    logging.raiseExceptions = False
    for name in _PREFECT_CLIENT_LOGGERS:  # each event it cannot send: two lines of it
        # A filter, not a level: Prefect's internal logger ignores its level.
        logging.getLogger(name).addFilter(lambda _record: False)


#: Prefect's loggers that report, line by line, on an API that no longer answers.
_PREFECT_CLIENT_LOGGERS = ("prefect.events.clients", "prefect._internal.concurrency")


_final_collections_skipped = False


def _skip_final_collections() -> None:
    """At exit, no final garbage collections: with torch, Prefect, MLflow and pandas
    loaded the interpreter's last collections walked millions of objects for 1.2-2 s
    after ``tune`` had done everything. ``gc.freeze()`` is registered before the run's
    own exit handlers, so it runs after them (atexit runs the last registered first):
    every handler still runs (the recorder's last writes, the cluster's close, Prefect's
    log and event flush) and objects are still freed by reference counting; only the
    cycle collector leaves the heap to the OS. Once per process."""
    global _final_collections_skipped
    if _final_collections_skipped:
        return
    _final_collections_skipped = True
    import atexit
    import gc

    atexit.register(gc.freeze)
    sys.unraisablehook = _quiet_dask_teardown


def _quiet_dask_teardown(unraisable) -> None:
    """Drop what a Dask object's ``__del__`` raises while the interpreter tears its
    modules down (their globals are None by then: "AttributeError: 'NoneType' object
    has no attribute 'closed'"), the cycle collector being off at exit; anything else
    is reported as Python would."""
    where = getattr(unraisable.object, "__module__", None) or ""
    if sys.is_finalizing() and where.startswith("distributed."):
        return
    sys.__unraisablehook__(unraisable)


class _InBackground(threading.Thread):
    """``fn(*args)`` in a daemon thread, now; :meth:`result` joins and re-raises."""

    def __init__(self, fn, *args) -> None:
        super().__init__(name=f"pipetune-{getattr(fn, '__name__', 'startup')}", daemon=True)
        self._fn, self._args = fn, args
        self._error: BaseException | None = None
        self._value = None
        self.start()

    def run(self) -> None:
        try:
            self._value = self._fn(*self._args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error = exc

    def result(self):
        self.join()
        if self._error is not None:
            raise self._error
        return self._value


def add_tune(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune", help="tune a job with PipeTune on Prefect + Dask, recorded in MLflow",
        description="Tune JOB.yaml. With no PREFECT_API_URL set, a local Prefect server is "
        "started on 127.0.0.1 for the run; with no --dask-address, a Dask LocalCluster.",
    )
    p.add_argument("job", metavar="JOB.yaml", nargs="?")
    p.add_argument("--trials", type=int, default=None, help="override search.trials")
    p.add_argument("--dask-address", default=None,
                   help="use an existing Dask scheduler (default: $PIPETUNE_DASK_ADDRESS); "
                   "tcp:// only on loopback, tls:// elsewhere (see --allow-insecure-dask)")
    p.add_argument("--allow-insecure-dask", action="store_true", default=None,
                   help="allow plain tcp:// to a scheduler on another host (a network you "
                   "trust); also PIPETUNE_DASK_ALLOW_INSECURE=1")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: sqlite:///./mlflow.db)")
    p.add_argument("--checkpoints", default=None,
                   help="checkpoint folder, fsspec URL, mlflow-artifacts: URI, or 'mlflow' (the "
                   "study run's artifacts, through the tracking server's artifact proxy); "
                   "default: $PIPETUNE_CHECKPOINTS, else $PIPETUNE_HOME/checkpoints")
    p.add_argument("--keep-checkpoints", choices=("best-and-last", "all"),
                   default="best-and-last",
                   help="after a trial ends, keep its last and best checkpoints (default), or all")
    p.add_argument("--no-pipetune", action="store_true",
                   help="hyperparameters only: every epoch under the default system config")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="STUDY_ID",
                   help="finish a stopped or crashed study of this job: the newest unfinished "
                   "one, or the one with this study id or Prefect flow run id")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="size the embedded cluster: N worker processes, one slot (one epoch "
                   "at a time) each (default: one per core); not with --dask-address")
    p.add_argument("--cores-per-worker", type=int, default=None, metavar="C",
                   help="cores each embedded worker offers its epoch (default: the machine's "
                   "cores over --workers, at least 1); the system space is judged by one "
                   "worker's cores, and N x C may exceed the machine's: epochs that sleep or "
                   "wait use none")
    p.add_argument("--keep-warm", type=float, default=None, metavar="SECONDS",
                   help="with no PREFECT_API_URL and no Dask address: keep the local Prefect "
                   "server and Dask cluster running this long after the last command, for "
                   "the next one (default: $PIPETUNE_KEEP_WARM_S, else 600; 0: start and "
                   "stop them with this command)")
    p.set_defaults(run=run_tune, after_parse=_job_after_resume)


# -- ui ----------------------------------------------------------------------------------
