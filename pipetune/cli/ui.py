"""``pipetune ui``: the MLflow UI on the study store, bound to 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipetune.errors import PipetuneError


def run_ui(args: argparse.Namespace) -> int:
    import subprocess

    from pipetune.tracking import default_tracking_uri

    uri = args.tracking_uri or default_tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise PipetuneError(f"no MLflow store at {uri}: run `pipetune tune JOB.yaml` here first")
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow_bin if mlflow_bin.exists() else "mlflow"), "ui",
           "--backend-store-uri", uri, "--host", args.host, "--port", str(args.port)]
    print(f"MLflow UI on http://{args.host}:{args.port} (store {uri}); Ctrl-C stops it",
          file=sys.stderr)
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 0


def add_ui(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ui", help="open the MLflow UI on the study store")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(run=run_ui)


# -- groundtruth --------------------------------------------------------------------------
