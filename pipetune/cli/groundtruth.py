"""``pipetune groundtruth list|check|repair|clear``: what PipeTune has learned."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetune.groundtruth import GroundTruth


def run_groundtruth(args: argparse.Namespace) -> int:
    from pipetune.groundtruth import GroundTruth

    gt = GroundTruth(args.path)
    if args.action == "list":
        entries = gt.entries()
        print(f"ground truth at {gt.path}: {len(gt)} records, {len(entries)} best configs")
        for c in gt.clusters():
            print(f"cluster {c['id']}: {c['size']} profiles, radius {c['radius']:.3f}")
        for e in entries:
            print(f"  cluster {e.cluster} batch~{e.bucket} {e.objective}: [{e.config.label()}] "
                  f"cost {e.cost:.3g}/sample, support {e.support}")
        return 0
    if args.action == "check":
        return _check_groundtruth(gt)
    if args.action == "repair":
        return _repair_groundtruth(gt)
    if not args.yes:
        answer = input(f"empty the ground truth at {gt.path} ({len(gt)} records)? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("left as it was")
            return 1
    removed = gt.clear()
    print(f"removed {removed} records from {gt.path}")
    return 0


def _check_groundtruth(gt: GroundTruth) -> int:
    found = gt.audit()
    if found.ok:
        print(f"ground truth at {gt.path}: {found.records} records, all valid")
        return 0
    print(f"ground truth at {gt.path}: {found.records} records, {len(found.problems)} problem(s)")
    for problem in found.problems:
        print(f"error: {gt.path}: {problem}", file=sys.stderr)
    print(f"run `pipetune groundtruth repair --path {shlex.quote(str(gt.path))}` to keep the "
          "valid records and drop the rest", file=sys.stderr)
    return 2


def _repair_groundtruth(gt: GroundTruth) -> int:
    done = gt.repair()
    found = done.found
    if found.ok:
        print(f"ground truth at {gt.path}: {found.records} records, all valid; nothing to do")
        return 0
    if done.moved is not None:
        print(f"{gt.path} was not a ground-truth file ({found.unreadable}); moved it to "
              f"{done.moved} and started an empty store")
    else:
        print(f"ground truth at {gt.path}: kept {done.kept} records, dropped {len(found.bad)}")
        for i, why in found.bad:
            print(f"  dropped record {i}: {why}")
    print(f"the file as it was is in {done.backup}")
    return 0


def add_groundtruth(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "groundtruth",
        help="list, check, repair or clear what PipeTune has learned",
        description="list: the clusters and best configs. check: validate every record "
        "(exit 2 if any is bad). repair: keep the valid records, drop the rest (the file "
        "as it was goes to <file>.bak). clear: remove every record.",
    )
    p.add_argument("action", choices=("list", "check", "repair", "clear"))
    p.add_argument("--path", default=None, help="ground-truth file (default: in $PIPETUNE_HOME)")
    p.add_argument("--yes", action="store_true", help="clear without asking")
    p.set_defaults(run=run_groundtruth)
