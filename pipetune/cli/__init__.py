"""The ``pipetune`` command line: the top room of ``pipetune/``.

One module per command group (:mod:`~pipetune.cli.tune`, :mod:`~pipetune.cli.ui`,
:mod:`~pipetune.cli.tracking`, :mod:`~pipetune.cli.groundtruth`,
:mod:`~pipetune.cli.bench`, :mod:`~pipetune.cli.deploy`). It is the only part of
``pipetune/`` allowed to import ``flows`` or ``deployments`` (and through
them Prefect); the rest of the library never does (``import-linter`` contracts in
``pyproject.toml``, checked by ``tests/test_layers.py``).

Each command group registers its parser with an ``add_*(subparsers)`` function that
sets ``run`` to a function ``(args) -> int``. Imports of the library (and so of
torch) happen inside those functions, so ``pipetune --help`` stays fast.

Exit codes: 0 success; 1 a study that ran and failed (every trial failed, or it
stopped on a broken workload: :class:`~pipetune.errors.BrokenWorkload`); 2 a user
error (a :class:`~pipetune.errors.PipetuneError`, printed as one ``error: ...`` line,
no traceback); ``128 + signum`` stopped by a signal.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from pipetune.errors import PipetuneError

EXIT_OK = 0
EXIT_USAGE = 2


def quiet_defaults(*, quiet_logs: bool = True) -> None:
    """No analytics or telemetry calls home; with ``quiet_logs``, the terminal shows
    Prefect's, Dask's and MLflow's warnings only (``serve`` and ``stream`` keep
    Prefect's run logs there). The flow run's own log lines still reach the Prefect
    server (its Logs tab): only the console handler is raised to WARNING, not the
    loggers."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if quiet_logs:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # no store-creation INFO


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


# -- validate --------------------------------------------------------------------------


def _run_validate(args: argparse.Namespace) -> int:
    import yaml

    from pipetune.spec import load_spec

    status = EXIT_OK
    for i, path in enumerate(args.jobs):
        try:
            spec = load_spec(path)
        except PipetuneError as e:
            _error(f"{path}: {e}")
            status = EXIT_USAGE
            continue
        # Space values this machine has too few cores for: run, they are left out.
        for drop in spec.fit()[1]:
            print(f"warning: {path}: {drop.line()}", file=sys.stderr)
        if i:
            print("---")
        print(f"# {path}: valid")
        print(yaml.safe_dump(spec.to_dict(), sort_keys=False, default_flow_style=None), end="")
    return status


def _add_validate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check job files and print them resolved",
        description="Check job files and print each one resolved, defaults filled in. "
        "A system.space value this machine has too few cores for is a warning on stderr "
        "(a study leaves it out). Exits 2 if any file is invalid.",
    )
    p.add_argument("jobs", nargs="+", metavar="JOB.yaml", help="job spec file(s)")
    p.set_defaults(run=_run_validate)


# -- the parser ------------------------------------------------------------------------

#: Registration functions, one per subcommand, in the order ``--help`` lists them.
def _add_orchestration(subparsers: argparse._SubParsersAction) -> None:
    from pipetune.cli.groundtruth import add_groundtruth as _add_groundtruth
    from pipetune.cli.service import add_service as _add_service
    from pipetune.cli.stack import add_stack as _add_stack
    from pipetune.cli.tracking import add_tracking as _add_tracking
    from pipetune.cli.tune import add_tune as _add_tune
    from pipetune.cli.ui import add_ui as _add_ui

    for add in (_add_tune, _add_ui, _add_tracking, _add_groundtruth, _add_stack, _add_service):
        add(subparsers)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from pipetune.cli.bench import add_bench

    add_bench(subparsers)


def _add_simulate(subparsers: argparse._SubParsersAction) -> None:
    from pipetune.cli.simulate import add_simulate

    add_simulate(subparsers)


def _add_deploy(subparsers: argparse._SubParsersAction) -> None:
    from pipetune.cli.deploy import add_deploy_commands

    add_deploy_commands(subparsers)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_validate,
    _add_orchestration,
    _add_bench,
    _add_simulate,
    _add_deploy,
]


class _Parser(argparse.ArgumentParser):
    """An argument parser that lets a command check what it parsed, as parsing: its
    ``after_parse(parser, args)`` default may rewrite ``args`` or call ``parser.error``
    (exit 2), so a bad command line is refused before anything runs."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201
        parsed, rest = super().parse_known_args(args, namespace)
        after = getattr(parsed, "after_parse", None)
        if after is not None:
            after(self, parsed)
        return parsed, rest


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pipetune",
        description="Tune a deep-learning job's hyperparameters and system parameters together.",
    )
    from pipetune import __version__

    parser.add_argument("--version", action="version",
                        version=f"pipetune {__version__} (Python {sys.version.split()[0]})")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:  # a warm service's driver, imports done, may take it
        from pipetune.cli.handover import hand_over
        from pipetune.cli.tune_startup import process_start_time

        code = hand_over(argv, process_start_time())
        if code is not None:
            return code
    args = build_parser().parse_args(argv)
    # A process started in the background of a non-interactive shell (``cmd &``, some CI
    # runners) inherits SIGINT ignored, and Python then leaves it ignored: ``kill -INT``
    # would do nothing. An explicit SIGINT asks pipetune to stop, like Ctrl-C.
    if (signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return args.run(args)
    except PipetuneError as e:
        _error(str(e))
        return e.exit_code
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        _error(str(e) or "interrupted")
        return 128 + signum

