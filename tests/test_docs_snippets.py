"""Every code block of the README and of the documentation site runs as written.

- ```python blocks: the blocks of one page run in order as one script, in a fresh process
  (a fresh namespace per page), in a temporary working directory that holds links to the
  repository's ``scenarios/`` and ``examples/``.
- ```bash and ```console blocks: each line that starts a ``python -m kvsim`` command (after
  an optional ``$`` prompt, with ``\\`` continuations joined) runs there and must exit 0.
  Other lines (``pip install``, ``mkdocs serve``) are not run.
- ```toml blocks that are whole scenarios (an ``[attention]`` table and an
  ``[[experiment]]``) are validated as a scenario file in that directory.
- A ```toml block preceded by a line ``<!-- file: NAME -->`` is also written to NAME in
  that directory, where the shell blocks after it find it (a page that walks through
  writing a file, then running it).
- A block preceded by a line ``<!-- no-test ... -->`` is not run (the text says why).

The site itself must build with ``mkdocs build --strict`` (skipped without mkdocs), and
every figure it shows, the committed report figures among them (``mkdocs_hooks.py``), is
in it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
NO_TEST = re.compile(r"^\s*<!--\s*no-test\b")
SAVE_AS = re.compile(r"^\s*<!--\s*file:\s*([\w.-]+)\s*-->")


def blocks(page: Path) -> list[tuple[str, str, bool, int, str | None]]:
    """``(language, code, runnable, line, file name)`` for each fenced block of ``page``."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(2):
            i += 1
            continue
        indent, lang, start = len(m.group(1)), m.group(2), i
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][indent:])
            i += 1
        save = SAVE_AS.match(prev)
        out.append((lang, "\n".join(body) + "\n", not NO_TEST.match(prev), start + 1,
                    save.group(1) if save else None))
        i += 1
    return out


def commands(code: str) -> list[str]:
    """The ``python -m kvsim`` commands of a shell block, continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", code)
    found = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ").split(" #", 1)[0].strip()
        if line.startswith("python -m kvsim"):
            found.append(line)
    return found


def is_scenario(code: str) -> bool:
    try:
        data = tomllib.loads(code)
    except tomllib.TOMLDecodeError:
        return False
    return "attention" in data and "experiment" in data


def _workdir(tmp_path: Path) -> Path:
    for name in ("scenarios", "examples"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    return tmp_path


def _env() -> dict:
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _runnable(page: Path) -> bool:
    return any(run and (lang == "python" or (lang in ("bash", "console") and commands(code))
                        or (lang == "toml" and is_scenario(code)))
               for lang, code, run, *_ in blocks(page))


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_id)
def test_page_blocks_run(page: Path, tmp_path: Path):
    work = _workdir(tmp_path)
    found = blocks(page)
    script = "".join(f"# {_id(page)}:{line}\n{code}" for lang, code, run, line, _ in found
                     if run and lang == "python")
    if script:
        (work / "page_snippets.py").write_text(script)
        done = subprocess.run([sys.executable, "page_snippets.py"], cwd=work, env=_env(),
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{_id(page)}: python blocks failed:\n{done.stderr[-3000:]}"
    for lang, code, run, line, save_as in found:
        if not run:
            continue
        if save_as:
            (work / save_as).write_text(code)
        if lang in ("bash", "console"):
            for command in commands(code):
                done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=work,
                                      env=_env(), capture_output=True, text=True, timeout=900)
                assert done.returncode == 0, (f"{_id(page)}:{line}: {command!r} exited "
                                              f"{done.returncode}:\n{done.stderr[-3000:]}")
        elif lang == "toml" and is_scenario(code):
            path = work / f"block_{line}.toml"
            path.write_text(code)
            done = subprocess.run([sys.executable, "-m", "kvsim", "validate", path.name],
                                  cwd=work, env=_env(), capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{_id(page)}:{line}: scenario invalid:\n{done.stderr}"


def test_no_test_marks_precede_blocks():
    """``no-test`` and ``file:`` marks are read only before a block: anywhere else they are
    a mistake."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if NO_TEST.match(line) or SAVE_AS.match(line):
                nxt = next((x for x in lines[i + 1:] if x.strip()), "")
                assert FENCE.match(nxt), f"{_id(page)}:{i + 1}: a block mark before no block"


def test_readme_is_short_and_self_contained():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for page in PAGES:  # users do not have the project's design notes
        assert "DESIGN" not in page.read_text(), f"{_id(page)} refers to DESIGN"


def test_site_builds_strict(tmp_path: Path):
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
    pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")
    pytest.importorskip("mkdocstrings", reason="the docs extra (mkdocstrings) is not installed")
    mkdocs = [sys.executable, "-m", "mkdocs"]
    done = subprocess.run([*mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=dict(_env(), NO_MKDOCS_2_WARNING="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    assert (site / "reference" / "index.html").exists()
    shown = {(html.parent / src).resolve() for html in site.rglob("*.html")
             for src in re.findall(r'(?:src|href)="([^"]+\.png)"', html.read_text())
             if not src.startswith(("/", "http"))}
    figures = {f for f in shown if "reports" in f.parts}
    assert len(figures) >= 8, "the site embeds the key report figures"
    assert all(f.is_file() for f in shown), sorted(str(f) for f in shown if not f.is_file())
