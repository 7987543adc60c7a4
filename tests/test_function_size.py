"""No function of ours is over 80 lines (issue 25 for ``flows/`` and ``pipetune/cli/``,
issue 34 for every package: ``pipetune/``, ``flows/``, ``tasks/``, ``deployments/``):
a long function is several steps that want names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
FILES = sorted(p for top in ("pipetune", "flows", "tasks", "deployments")
               for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def function_sizes(path: Path) -> list[tuple[str, int]]:
    """``(name:line, lines)`` of every function and method in ``path``, nested ones too,
    each counted from its ``def`` (decorators apart) to its last line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(f"{node.name}:{node.lineno}", node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_rule_sees_the_files():
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"flows/study.py", "pipetune/cli/tune.py", "pipetune/engine/study.py",
            "tasks/task_run_sink.py", "deployments/serve.py",
            "pipetune/workloads/datasets/idx.py"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_function_is_over_80_lines(path):
    too_long = [(name, size) for name, size in function_sizes(path) if size > MAX_LINES]
    assert not too_long, f"{path.relative_to(ROOT)}: over {MAX_LINES} lines: {too_long}"


def test_the_count_is_def_to_last_line(tmp_path):
    source = tmp_path / "f.py"
    source.write_text("@decorator\ndef f(\n    a,\n):\n    return a\n")
    assert function_sizes(source) == [("f:2", 4)]
