"""The layers hold: ``lint-imports`` checks the contracts in ``pyproject.toml`` (the
library never imports Prefect, flows, tasks or deployments; only ``pipetune.cli``
reaches up; tasks below flows below deployments)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_import_contract_is_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
