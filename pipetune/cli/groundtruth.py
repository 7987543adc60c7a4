"""``pipetune groundtruth list|check|repair|clear|export|import``: what PipeTune has learned.

``--path`` (or ``--url``) names the store: a path or a URL (see
:mod:`pipetune.groundtruth.location`); messages name it by its ``location``, a
database URL with its password as ``***``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetune.groundtruth import GroundTruth

EXIT_USAGE = 2


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def run_groundtruth(args: argparse.Namespace) -> int:
    from pipetune.groundtruth import GroundTruth

    if args.action in ("export", "import") and not args.file:
        _error(f"groundtruth {args.action} needs a FILE.json")
        return EXIT_USAGE
    if args.action not in ("export", "import") and args.file:
        _error(f"groundtruth {args.action} takes no FILE (got {args.file!r}); use --path")
        return EXIT_USAGE
    gt = GroundTruth(args.path)
    try:
        return _ACTIONS[args.action](gt, args)
    except OSError as err:  # an export file that cannot be written, ...
        _error(f"{err.filename or gt.location}: {err.strerror or err}")
        return EXIT_USAGE


def _list_groundtruth(gt: GroundTruth, args: argparse.Namespace) -> int:
    entries = gt.entries()
    print(f"ground truth at {gt.location}: {len(gt)} records, {len(entries)} best configs")
    for c in gt.clusters():
        print(f"cluster {c['id']}: {c['size']} profiles, radius {c['radius']:.3f}")
    for e in entries:
        print(f"  cluster {e.cluster} batch~{e.bucket} {e.objective}: [{e.config.label()}] "
              f"cost {e.cost:.3g}/sample, support {e.support}")
    return 0


def _clear_groundtruth(gt: GroundTruth, args: argparse.Namespace) -> int:
    if not args.yes:
        answer = input(f"empty the ground truth at {gt.location} ({len(gt)} records)? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("left as it was")
            return 1
    removed = gt.clear()
    print(f"removed {removed} records from {gt.location}")
    return 0


def _check_groundtruth(gt: GroundTruth, args: argparse.Namespace) -> int:
    found = gt.audit()
    where = gt.location
    if found.ok:
        print(f"ground truth at {where}: {found.records} records, all valid")
        return 0
    print(f"ground truth at {where}: {found.records} records, {len(found.problems)} problem(s)")
    for problem in found.problems:
        _error(f"{where}: {problem}")
    print(f"run `pipetune groundtruth repair --path {shlex.quote(where)}` to keep the "
          "valid records and drop the rest", file=sys.stderr)
    return EXIT_USAGE


def _repair_groundtruth(gt: GroundTruth, args: argparse.Namespace) -> int:
    done = gt.repair()
    found = done.found
    where = gt.location
    if found.ok:
        print(f"ground truth at {where}: {found.records} records, all valid; nothing to do")
        return 0
    if done.moved is not None:
        print(f"{where} was not a ground-truth file ({found.unreadable}); moved it to "
              f"{done.moved} and started an empty store")
    else:
        print(f"ground truth at {where}: kept {done.kept} records, dropped {len(found.bad)}")
        for i, why in found.bad:
            print(f"  dropped {found.unit} {i}: {why}")
    what = "file" if found.unit == "record" else "table"
    print(f"the {what} as it was is in {done.backup}")
    return 0


def _export_groundtruth(gt: GroundTruth, args: argparse.Namespace) -> int:
    n = gt.export_json(args.file)
    print(f"exported {n} records from {gt.location} to {args.file}")
    return 0


def _import_groundtruth(gt: GroundTruth, args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipetune.groundtruth import JsonStore

    source = JsonStore(Path(args.file).expanduser())
    if not source.path.is_file():
        _error(f"{args.file}: no such file")
        return EXIT_USAGE
    found = source.audit()
    if not found.ok:  # the whole import is refused: nothing is written
        for problem in found.problems:
            _error(f"{args.file}: {problem}")
        print(f"nothing imported into {gt.location}", file=sys.stderr)
        return EXIT_USAGE
    n = gt.import_json(source.path)
    print(f"imported {n} records from {args.file} into {gt.location}")
    return 0


_ACTIONS = {
    "list": _list_groundtruth,
    "check": _check_groundtruth,
    "repair": _repair_groundtruth,
    "clear": _clear_groundtruth,
    "export": _export_groundtruth,
    "import": _import_groundtruth,
}


def add_groundtruth(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "groundtruth",
        help="list, check, repair, clear, export or import what PipeTune has learned",
        description="list: the clusters and best configs. check: validate every record "
        "(exit 2 if any is bad). repair: keep the valid records, drop the rest (the store "
        "as it was is backed up first). clear: remove every record. export FILE.json: "
        "write every record to a JSON ground-truth file. import FILE.json: append the "
        "records of such a file (all or nothing: exit 2 if any is bad).",
    )
    p.add_argument("action", choices=tuple(_ACTIONS))
    p.add_argument("file", nargs="?", default=None, metavar="FILE.json",
                   help="for export and import: the JSON file")
    p.add_argument("--path", "--url", dest="path", default=None,
                   help="the ground truth: a .json file, a SQLite file, or a URL "
                   "(sqlite:///FILE, postgresql://USER@HOST/DB); default: "
                   "$PIPETUNE_GROUNDTRUTH, else $PIPETUNE_HOME/groundtruth.db")
    p.add_argument("--yes", action="store_true", help="clear without asking")
    p.set_defaults(run=run_groundtruth)
