"""Every command the README shows runs, as written, in a copy of this checkout: the main
job, ``validate``, your own model's example, the MLflow UI on the study just run, and
the service's status. Only what installs is left out (CI's own install is the README's
test command) and the test command itself. ``.venv`` in the copy is the environment
these tests run in."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from known import tune_env
from test_docs import README, ROOT, fenced_blocks, shell_commands

from pipetune.net import free_port, port_free

INSTALLS = ("python3 -m venv", ".venv/bin/pip ")


def readme_command_lines() -> list[str]:
    """The README's shell lines, each as the shell would run it, without the steps that
    install (``python3 -m venv``, ``pip install``) or run the tests."""
    lines = []
    for language, body in fenced_blocks(README.read_text()):
        if language != "bash":
            continue
        for line in body.strip().split("\n"):
            kept = [c for c in shell_commands(line) if not c.startswith(INSTALLS)]
            if kept and not any("pytest" in c for c in kept):
                lines.append(" && ".join(kept))
    return lines


def _copy_of_checkout(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "examples", copy / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / ".venv").symlink_to(Path(sys.prefix))
    return copy


def _serve_and_stop(line: str, cwd: Path, env: dict) -> str:
    """Start a command that serves (``pipetune ui``), wait until its page answers, stop
    it as Ctrl-C would; its output."""
    port = 5000
    if not port_free("127.0.0.1", port):  # the README's port is taken on this machine
        port = free_port()
        line += f" --port {port}"
    proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    try:
        while True:
            assert proc.poll() is None, f"`{line}` exited {proc.returncode}: {proc.stdout.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    assert page.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, f"`{line}` never answered on {port}"
                time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    return out


def test_readme_shows_the_commands_this_test_runs():
    lines = readme_command_lines()
    assert lines[0] == ".venv/bin/pipetune tune examples/lenet_digits.yaml"
    assert any(" ui " in f" {line} " for line in lines)
    assert all("pytest" not in line for line in lines)


def test_every_readme_command_runs_on_a_copy_of_the_checkout(tmp_path):
    copy = _copy_of_checkout(tmp_path)
    env = tune_env(tmp_path)
    for line in readme_command_lines():
        if " ui " in f" {line} ":
            out = _serve_and_stop(line, copy, env)
            assert "Traceback" not in out, out[-3000:]
            continue
        proc = subprocess.run(["bash", "-c", line], cwd=copy, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, f"`{line}`:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        if " tune " in f" {line} ":  # the study ran to its best trial
            assert re.search(r"^best \w+: [-\d.]+ \(trial \d+\)", proc.stdout, re.M), \
                proc.stdout[-3000:]
