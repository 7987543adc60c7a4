"""``pipetune service``: the local Prefect server and Dask cluster kept warm between
``pipetune tune`` commands (:mod:`pipetune.service`)."""

from __future__ import annotations

import argparse
import time


def _status(_args: argparse.Namespace) -> int:
    from pipetune.service import services

    found = [s for s in services() if s["alive"]]
    if not found:
        print("no warm service runs (the next `pipetune tune` starts one)")
        return 0
    for s in found:
        idle = "in use" if s["leases"] else f"stops when idle {s['idle_s']:g} s"
        spares = " and ".join(s["spares"]) or "none yet"
        print(f"pid {s['pid']}: Prefect {s['api_url'].removesuffix('/api')}, Dask "
              f"{s.get('dask_address') or 'starting'}, for {s['cwd']}, up "
              f"{(time.time() - s['started']) / 60:.1f} min, {idle}; spare {spares} "
              f"waiting; files {s['folder']}")
        for name in s.get("failed_spares", ()):
            print(f"  the spare {name} exited before it waited: see "
                  f"{s['folder']}/{name}.log")
    return 0


def _stop(_args: argparse.Namespace) -> int:
    from pipetune.service import stop_all

    stopped = stop_all()
    for s in stopped:
        print(f"stopped pid {s['pid']} (Prefect {s['api_url'].removesuffix('/api')}, for "
              f"{s['cwd']})" + (f"; {len(s['leases'])} command(s) were using it"
                                if s["leases"] else ""))
    if not stopped:
        print("no warm service was running")
    return 0


def add_service(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "service", help="the local Prefect server and Dask cluster kept warm between tunes",
        description="`pipetune tune` with no PREFECT_API_URL and no Dask address keeps a "
        "local Prefect server and Dask cluster running after it ends, for the next command "
        "(until idle for --keep-warm / $PIPETUNE_KEEP_WARM_S seconds, default 600).")
    sub = p.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    sub.add_parser("status", help="list the warm services of this pipetune home"
                   ).set_defaults(run=_status)
    sub.add_parser("stop", help="stop them now").set_defaults(run=_stop)
