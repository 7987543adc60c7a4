"""CPU per process over README studies: where a study's bookkeeping CPU goes.

Runs ``examples/lenet_digits.yaml`` three times in one process, through the real flow
(local Prefect server, embedded cluster, MLflow on SQLite), and prints per study: the
tuning wall, the CPU seconds of this (flow) process, of the Prefect server, and of
every other process it started (Dask workers, the recorder). Point it at another
checkout to compare two designs on the same machine minute:

    python benchmarks/bookkeeping_cpu.py [CHECKOUT]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
sys.path.insert(0, str(ROOT))


def _cpu(proc) -> float:
    import psutil

    try:
        return sum(proc.cpu_times()[:2])
    except psutil.Error:
        return 0.0


def main() -> int:
    import psutil

    work = Path(tempfile.mkdtemp(prefix="pipetune-cpu-"))
    os.environ.update(PIPETUNE_HOME=str(work / "home"), PREFECT_HOME=str(work / "prefect"),
                      PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true",
                      PREFECT_LOGGING_LEVEL="WARNING", DASK_LOGGING__DISTRIBUTED="warning",
                      PYTHONPATH=str(ROOT))
    from pipetune.prefect_server import LocalPrefectServer

    server = LocalPrefectServer(log_path=work / "prefect.log").start()
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        from flows.study import study_flow
        from pipetune.dask.cluster import close_shared_cluster, shared_cluster
        from pipetune.tracking import ensure_experiment

        shared_cluster()
        uri = f"sqlite:///{work / 'mlflow.db'}"
        ensure_experiment(uri)
        me, srv = psutil.Process(), psutil.Process(server.process.pid)

        def sample() -> dict[str, float]:
            kids = [c for c in me.children(recursive=True) if c.pid != srv.pid]
            return {"flow": _cpu(me), "server": _cpu(srv), "others": sum(map(_cpu, kids))}

        print(f"checkout {ROOT}")
        for i in range(3):
            before = sample()
            summary = study_flow(job=str(ROOT / "examples" / "lenet_digits.yaml"),
                                 tracking_uri=uri)
            after = sample()
            rows = summary["epoch_timings"]
            cpu = ", ".join(f"{k} {after[k] - before[k]:.1f}" for k in before)
            print(f"study {i}: {len(rows)} epochs, compute {sum(r['compute_s'] for r in rows):.1f}"
                  f" s, tuning {summary['tuning_wall_s']:.1f} s, CPU-s: {cpu}", flush=True)
        close_shared_cluster()
    finally:
        server.stop()
    time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
