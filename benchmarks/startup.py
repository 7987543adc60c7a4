"""Where the seconds of ``pipetune tune`` go outside tuning: the README's command, run as a
user runs it, in a fresh temporary HOME (so ``~/.pipetune`` and ``./mlflow.db`` are new)
with a fresh or a warm ``PREFECT_HOME``.

    .venv/bin/python benchmarks/startup.py                  # 3 runs, fresh and warm home
    .venv/bin/python benchmarks/startup.py --runs 5 --home warm
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/startup.py  # compare

Each run prints the command's own marks (``start-up (s from process start): ...``, the
last line ``tune`` prints) plus the process's exit as seen from here, then the whole
wall time, the tuning wall time (``tuning wall time`` in the summary) and their
difference: what the issue asks to keep at or under 8 s. The table at the end gives
min and median per mark, and a section to paste into ``benchmarks/RESULTS.md``.

The machine is often shared: the 1-minute load average at the start of each run is
printed beside it; compare runs made under the same load only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK_LINE = re.compile(r"^start-up \(s from process start\): (.*)$", re.M)
TUNING = re.compile(r"tuning wall time ([0-9.]+) s")
TARGET_S = 8.0


def pipetune_command() -> list[str]:
    script = Path(sys.executable).with_name("pipetune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipetune"]


def clean_env(home: Path, prefect_home: Path, keep_warm_s: float = 0) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PIPETUNE_HOME", "MLFLOW_TRACKING_URI",
                        "PIPETUNE_DASK_ADDRESS", "PIPETUNE_CHECKPOINTS", "PIPETUNE_GROUNDTRUTH")}
    env.update(HOME=str(home), PREFECT_HOME=str(prefect_home),
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
               MLFLOW_DISABLE_TELEMETRY="true", PIPETUNE_KEEP_WARM_S=str(keep_warm_s))
    return env


def warm_prefect_home(prefect_home: Path) -> None:
    """A PREFECT_HOME whose server database exists and is migrated: start a server on
    it once (as a first ``tune`` would) and stop it."""
    sys.path.insert(0, str(ROOT))
    from pipetune.prefect_server import LocalPrefectServer

    old = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(prefect_home)
    try:
        with LocalPrefectServer(log_path=prefect_home.parent / "warm-up.log"):
            pass
    finally:
        if old is None:
            os.environ.pop("PREFECT_HOME", None)
        else:
            os.environ["PREFECT_HOME"] = old


def one_run(job: Path, prefect_home: Path | None, keep: bool, work: Path | None = None) -> dict:
    """Run ``pipetune tune JOB`` once in a new temporary HOME and working folder, or in
    ``work`` (kept, the warm service's: its home, store and service reused)."""
    reuse = work is not None
    if work is None:
        work = Path(tempfile.mkdtemp(prefix="pipetune-startup-"))
    home = work / "home"
    if not home.exists():
        home.mkdir()
        shutil.copytree(job.parent, work / job.parent.name)
    env = clean_env(home, prefect_home or work / "prefect", WARM_S if reuse else 0)
    load = os.getloadavg()[0]
    # Output to files, not pipes: a pipe stays open until every process that inherited
    # it is gone (the cluster's fork server finishes exiting in the background after
    # the command), while the shell hands the prompt back when the command exits.
    with open(work / "stdout.txt", "w") as out_f, open(work / "stderr.txt", "w") as err_f:
        started = time.time()
        proc = subprocess.Popen(
            [*pipetune_command(), "tune", f"{job.parent.name}/{job.name}"], cwd=work,
            env=env, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL)
        proc.wait(timeout=900)
        total = time.time() - started
    out = (work / "stdout.txt").read_text()
    marks: dict[str, float] = {}
    found = MARK_LINE.search(out)
    if found:
        for part in found.group(1).split(", "):
            name, _, value = part.rpartition(" ")
            marks[name] = float(value)
    marks["process exited"] = total
    tuning = TUNING.search(out)
    result = {
        "rc": proc.returncode, "total": total, "load": load, "marks": marks,
        "tuning": float(tuning.group(1)) if tuning else float("nan"), "work": str(work),
    }
    result["outside"] = total - result["tuning"]
    if proc.returncode != 0:
        result["stderr"] = (work / "stderr.txt").read_text()[-3000:]
    if not keep and not reuse and proc.returncode == 0:
        shutil.rmtree(work, ignore_errors=True)
    return result


#: The warm service's keep-warm time in ``--home service`` runs.
WARM_S = 600


def stop_service(work: Path) -> None:
    env = clean_env(work / "home", work / "prefect", WARM_S)
    subprocess.run([*pipetune_command(), "service", "stop"], cwd=work, env=env,
                   capture_output=True, timeout=120)


def summarize(label: str, runs: list[dict]) -> list[str]:
    ok = [r for r in runs if r["rc"] == 0]
    lines = [f"### {label}: {len(ok)} of {len(runs)} runs ok"]
    if not ok:
        return lines
    names: list[str] = []
    for r in ok:
        for name in sorted(r["marks"], key=r["marks"].get):
            if name not in names:
                names.append(name)
    names.sort(key=lambda n: statistics.median(r["marks"][n] for r in ok if n in r["marks"]))
    lines.append("")
    lines.append("| s from process start | min | median |")
    lines.append("|---|---:|---:|")
    for name in names:
        values = [r["marks"][name] for r in ok if name in r["marks"]]
        lines.append(f"| {name} | {min(values):.1f} | {statistics.median(values):.1f} |")
    for key, what in (("tuning", "tuning wall time"), ("total", "whole command"),
                      ("outside", "whole command minus tuning")):
        values = [r[key] for r in ok]
        lines.append(f"| **{what}** | {min(values):.1f} | {statistics.median(values):.1f} |")
    loads = ", ".join(f"{r['load']:.1f}" for r in ok)
    lines.append("")
    lines.append(f"1-minute load average at each run's start: {loads} (2 cores)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--job", default=str(ROOT / "examples" / "lenet_digits.yaml"))
    parser.add_argument("--home", choices=("fresh", "warm", "both", "service"), default="both",
                        help="PREFECT_HOME: new for every run, one migrated beforehand, or "
                        "both (each command starts and stops its own server and cluster); "
                        "service: one HOME, working folder and MLflow store for every run "
                        "and the warm service (pipetune.service) the default keeps, after "
                        "one warm-up run not counted")
    parser.add_argument("--keep", action="store_true", help="keep each run's folder")
    parser.add_argument("--pause", type=float, default=5.0,
                        help="seconds between runs: the last run's fork server and workers "
                        "finish exiting in the background after the command (default 5)")
    args = parser.parse_args(argv)
    job = Path(args.job).resolve()
    sections: list[str] = []
    kinds = ("fresh", "warm") if args.home == "both" else (args.home,)
    for kind in kinds:
        prefect_home = None
        work = None
        if kind == "service":
            work = Path(tempfile.mkdtemp(prefix="pipetune-startup-service-"))
            r = one_run(job, None, True, work)
            print(f"[service warm-up run] rc {r['rc']}: whole {r['total']:.1f} s", flush=True)
        if kind == "warm":
            prefect_home = Path(tempfile.mkdtemp(prefix="pipetune-prefect-")) / "prefect"
            warm_prefect_home(prefect_home)
        runs = []
        for i in range(args.runs):
            time.sleep(args.pause)
            r = one_run(job, prefect_home, args.keep, work)
            runs.append(r)
            marks = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["marks"].items(),
                                                                 key=lambda kv: kv[1]))
            print(f"[{kind} PREFECT_HOME, run {i + 1}] rc {r['rc']}, load {r['load']:.1f}: "
                  f"whole {r['total']:.1f} s, tuning {r['tuning']:.1f} s, "
                  f"outside tuning {r['outside']:.1f} s (target <= {TARGET_S:.0f})\n"
                  f"    {marks}", flush=True)
            if r["rc"] != 0:
                print(r.get("stderr", ""), file=sys.stderr)
        if prefect_home is not None:
            shutil.rmtree(prefect_home.parent, ignore_errors=True)
        if work is not None:
            stop_service(work)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        sections += summarize(f"`pipetune tune {job.name}`, {kind} PREFECT_HOME", runs) + [""]
    print("\n".join(["", "## Start-up and shutdown of `pipetune tune` (benchmarks/startup.py)",
                     "", *sections]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
