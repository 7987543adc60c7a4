"""The README and docs/ hold together: every relative link reaches a file (and, for a
Markdown target with an ``#anchor``, a heading with that GitHub slug); every job file
they show validates; every Python block parses; every ``pipetune`` command they show
parses with pipetune's own argument parser; the README stays short and leads into
docs/. Each checker returns the problems it found, and is also run on bad input here,
so a checker that stopped finding anything fails too."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def markdown_files() -> list[Path]:
    files = [README, *sorted(DOCS.glob("*.md"))]
    assert len(files) > 1, "docs/ holds no Markdown file"
    return files


# -- reading Markdown ----------------------------------------------------------------

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block, in order."""
    blocks: list[tuple[str, str]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        language = m["info"].strip().split(" ")[0].lower()
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append((language, "\n".join(body) + "\n"))
        i += 1
    return blocks


def without_fences(text: str) -> str:
    """``text`` without its fenced code blocks (a ``# comment`` in one is no heading, a
    ``[a](b)`` in one no link)."""
    out: list[str] = []
    in_fence: str | None = None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if in_fence is None and m:
            in_fence = m["fence"]
            continue
        if in_fence is not None:
            if line.strip().startswith(in_fence):
                in_fence = None
            continue
        out.append(line)
    return "\n".join(out)


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and its inline code spans."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", without_fences(text))


INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def links(text: str) -> list[str]:
    """Every link target in ``text``'s prose: inline ``[a](b)`` and reference
    ``[a]: b`` links."""
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_LINK.findall(body)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without Markdown markup, lower case,
    anything but letters, digits, ``_``, ``-`` and spaces dropped, spaces as ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of ``text``'s headings (a repeated slug gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in without_fences(text).split("\n"):  # inline code stays: heading text
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m[1])
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


# -- the checkers: each returns its problems, and how much it checked --------------


def link_problems(source: Path, text: str) -> tuple[list[str], int]:
    """Relative links of ``text`` (in file ``source``) that reach nothing."""
    problems: list[str] = []
    checked = 0
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http(s):, mailto:, ...
            continue
        checked += 1
        path_part, _, anchor = target.partition("#")
        path = (source.parent / path_part).resolve() if path_part else source
        if not path.exists():
            problems.append(f"{source.name}: {target}: no file {path}")
            continue
        if anchor and path.suffix == ".md":
            if anchor not in anchors(path.read_text()):
                problems.append(f"{source.name}: {target}: no heading #{anchor} in {path.name}")
    return problems, checked


def job_file_problems(text: str) -> tuple[list[str], int]:
    """YAML blocks with a top-level ``workload:`` that are not valid job files; a block
    that names its example file (first line ``# examples/....yaml``) must also say what
    that file says."""
    from pipetune.spec import JobSpec

    problems: list[str] = []
    checked = 0
    for language, body in fenced_blocks(text):
        if language not in ("yaml", "yml"):
            continue
        try:
            data = yaml.safe_load(body)
        except yaml.YAMLError as e:
            problems.append(f"YAML that does not parse: {e}")
            continue
        if not isinstance(data, dict) or "workload" not in data:
            continue  # a fragment
        checked += 1
        try:
            JobSpec.from_dict(data)
        except Exception as e:  # noqa: BLE001 - reported, with the block's name
            problems.append(f"job {data.get('name')!r}: {type(e).__name__}: {e}")
        first = body.lstrip().split("\n", 1)[0]
        m = re.match(r"#\s*(examples/\S+\.ya?ml)\s*$", first)
        if m:
            example = yaml.safe_load((ROOT / m[1]).read_text())
            if example != data:
                problems.append(f"job {data.get('name')!r} differs from {m[1]}")
    return problems, checked


def python_problems(text: str) -> tuple[list[str], int]:
    problems: list[str] = []
    checked = 0
    for language, body in fenced_blocks(text):
        if language not in ("python", "py"):
            continue
        checked += 1
        try:
            ast.parse(body)
        except SyntaxError as e:
            problems.append(f"python block does not parse: line {e.lineno}: {e.msg}")
    return problems, checked


#: Placeholders a shown command may use, and what stands in for them here.
PLACEHOLDERS = {"JOB.yaml": "examples/tiny_synthetic.yaml", "STUDY_ID": "0123456789abcdef"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
PIPETUNE = re.compile(r"^(?:\S*/)?pipetune$")


def shell_commands(body: str) -> list[str]:
    """The simple commands of a shell block: continuation lines joined, a ``$ `` prompt
    dropped, comments dropped, split at ``&&``, ``;``, ``|`` and ``&``."""
    body = re.sub(r"\\\n", " ", body)
    commands: list[str] = []
    for line in body.split("\n"):
        line = re.sub(r"^\s*\$\s+", "", line)
        if not line.strip():
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in SEPARATORS:
                if current:
                    commands.append(shlex.join(current))
                current = []
            else:
                current.append(token)
        if current:
            commands.append(shlex.join(current))
    return commands


def command_problems(text: str) -> tuple[list[str], int]:
    """``pipetune ...`` commands of the shell blocks that pipetune's parser refuses."""
    from pipetune.cli import build_parser

    problems: list[str] = []
    checked = 0
    for language, body in fenced_blocks(text):
        if language not in ("bash", "sh", "shell", "console"):
            continue
        for command in shell_commands(body):
            words = shlex.split(command)
            # Environment assignments before the command (``A=1 pipetune ...``).
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]
            if not words or not PIPETUNE.match(words[0]):
                continue
            args = [PLACEHOLDERS.get(w, w) for w in words[1:]]
            if any("$" in a or re.search(r"<[^>]*>", a) for a in args):
                continue  # a shell variable or a placeholder: nothing to parse
            checked += 1
            try:
                build_parser().parse_args(args)
            except SystemExit as e:
                problems.append(f"`{command}`: pipetune's parser refuses it (exit {e.code})")
    return problems, checked


# -- the tests -------------------------------------------------------------------------


def _run(checker, *, with_source: bool = False) -> tuple[list[str], int]:
    problems: list[str] = []
    checked = 0
    for path in markdown_files():
        text = path.read_text()
        found, n = checker(path, text) if with_source else checker(text)
        problems += [f"{path.relative_to(ROOT)}: {p}" for p in found]
        checked += n
    return problems, checked


def test_every_relative_link_reaches_a_file_and_heading():
    problems, checked = _run(link_problems, with_source=True)
    assert checked >= 20, f"only {checked} relative links found: is the link reader broken?"
    assert problems == []


def test_every_job_file_shown_is_valid():
    problems, checked = _run(job_file_problems)
    assert checked >= 2, f"only {checked} job files found (README's first job, Job files)"
    assert problems == []


def test_every_python_block_parses():
    problems, checked = _run(python_problems)
    assert checked >= 2, f"only {checked} python blocks found"
    assert problems == []


def test_every_pipetune_command_shown_parses(capsys):
    problems, checked = _run(command_problems)
    assert checked >= 10, f"only {checked} pipetune commands found"
    assert problems == [], capsys.readouterr().err


def test_readme_is_short_and_leads_into_docs():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    targets = {t.partition("#")[0] for t in links(text)}
    assert {"docs/README.md", "docs/glossary.md"} <= targets


def test_docs_index_lists_every_file_glossary_first():
    index = (DOCS / "README.md").read_text()
    listed = [t for t in links(index) if not t.startswith("../") and "#" not in t]
    assert listed and listed[0] == "glossary.md"
    files = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert files and files <= set(listed), files - set(listed)


def test_layout_lists_the_library_layers_pyproject_enforces():
    """docs/layout.md copies the library's layers contract; the copy must not go stale."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = [c for c in contracts["contracts"] if c.get("containers") == ["pipetune"]]
    assert len(layers) == 1
    copies = [body.strip().split("\n") for language, body
              in fenced_blocks((DOCS / "layout.md").read_text())
              if language == "text" and body.startswith("__main__")]
    assert copies == [layers[0]["layers"]]


# -- the checkers catch what they are for --------------------------------------------


def test_checkers_report_bad_input(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Two words\n")
    bad = (
        "[gone](no-such-file.md) [anchor](page.md#no-such-heading) [ok](page.md#two-words)"
        " `[in code](nowhere.md)`\n\n```text\n[in a block](nowhere.md)\n```\n"
    )
    problems, checked = link_problems(page, bad)
    assert checked == 3 and len(problems) == 2, problems

    problems, checked = job_file_problems(
        "```yaml\nname: x\nworkload: {name: no_such_workload}\n```\n"
        "```yaml\nsearch: {trials: 2}\n```\n"
    )
    assert checked == 1 and len(problems) == 1, problems

    problems, checked = python_problems("```python\ndef f(:\n```\n")
    assert checked == 1 and len(problems) == 1

    problems, checked = command_problems(
        "```bash\n$ pipetune tune\ncd x && .venv/bin/pipetune nosuchcommand  # no\n"
        "pipetune ui --study latest; echo $HOME\n```\n"
    )
    assert checked == 3 and len(problems) == 2, problems


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("What `pipetune tune` shows, and where to look afterwards",
         "what-pipetune-tune-shows-and-where-to-look-afterwards"),
        ("PostgreSQL restarts (team mode)", "postgresql-restarts-team-mode"),
        ("cpu_wait_s", "cpu_wait_s"),
        ("One-time knob, one-time cost", "one-time-knob-one-time-cost"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug
