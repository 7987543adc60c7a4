"""``pipetune tracking flush STUDY_ID``: send the MLflow writes a study left waiting.

A study whose MLflow store did not answer when it ended (a tracking server down, a
SQLite store locked) keeps those writes in its spool
(:mod:`pipetune.tracking.spool`), says so in one ``warning:`` line and names this
command. It sends them in order, each once; run it again until it says nothing waits.
"""

from __future__ import annotations

import argparse
import sys

#: Exit code when the store still does not answer (the writes keep waiting).
EXIT_UNSENT = 1


def run_flush(args: argparse.Namespace) -> int:
    from pipetune.errors import PipetuneError
    from pipetune.tracking.flush import send_spool
    from pipetune.tracking.spool import StoreUnavailable

    try:
        sent, uri = send_spool(args.study_id)
    except StoreUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNSENT
    except PipetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if uri is None:
        print(f"study {args.study_id}: no MLflow writes wait")
    else:
        print(f"study {args.study_id}: {sent} waiting MLflow write(s) sent to {uri}")
    return 0


def add_tracking(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tracking", help="the MLflow record of studies",
        description="The MLflow record of studies.")
    commands = p.add_subparsers(dest="tracking_command", metavar="COMMAND", required=True)
    flush = commands.add_parser(
        "flush", help="send the MLflow writes a study left waiting",
        description="Send, in order and each once, the MLflow writes study STUDY_ID "
        "left in its spool ($PIPETUNE_HOME/studies/STUDY_ID/mlflow-spool.jsonl) because "
        f"its store did not answer. Exits {EXIT_UNSENT} if the store still does not "
        "answer (the writes keep waiting), 2 if there is no such study.")
    flush.add_argument("study_id", metavar="STUDY_ID")
    flush.set_defaults(run=run_flush)
