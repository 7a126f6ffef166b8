"""Imports that a folder named ``kvsim`` in the working directory cannot break."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kvsim
from kvsim._version import __version__

ROOT = Path(kvsim.__file__).resolve().parent.parent

TINY = """\
name = "tiny"
seeds = [0]
[attention]
source = "field"
T = 48
heads = 1
[policies.window]
[[experiment]]
name = "decode"
prompt_len = 24
budgets = [8]
"""

# What an editable install does: kvsim is found by a finder behind the path finder, so a
# folder named kvsim on sys.path[0] (the working directory) becomes a namespace package.
EDITABLE = f"""\
import importlib.util, runpy, sys
from importlib.machinery import PathFinder
from pathlib import Path
ROOT = Path({str(ROOT)!r})

class Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] != "kvsim":
            return None
        base = ROOT.joinpath(*name.split("."))
        if (base / "__init__.py").exists():
            return importlib.util.spec_from_file_location(
                name, base / "__init__.py", submodule_search_locations=[str(base)])
        if base.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(name, base.with_suffix(".py"))
        return None

sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, Finder)
sys.argv = ["kvsim", *sys.argv[1:]]
runpy.run_module("kvsim", run_name="__main__", alter_sys=True)
"""


def test_version_is_the_projects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert kvsim.__version__ == __version__ == project["version"]


def test_the_package_never_imports_its_own_top_level():
    """Every module imports submodules (``from kvsim.x import y``), never ``kvsim``
    itself, which a namespace package of the same name can replace."""
    offenders = [f"{path.relative_to(ROOT)}:{i}" for path in (ROOT / "kvsim").rglob("*.py")
                 if path.name != "__main__.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if re.match(r"\s*(import kvsim\s*(#.*)?$|from kvsim import )", line)]
    assert offenders == []


@pytest.mark.parametrize("install", ["path", "editable"])
def test_cli_runs_beside_a_folder_named_kvsim(tmp_path, install):
    (tmp_path / "kvsim" / "scenarios").mkdir(parents=True)
    (tmp_path / "kvsim" / "scenarios" / "tiny.toml").write_text(TINY)
    (tmp_path / "kvsim" / "errors.py").write_text("raise SystemExit('shadowed')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["kvsim/scenarios/tiny.toml", "--out", "out", "--quiet", "--workers", "1"]
    if install == "path":
        command = [sys.executable, "-m", "kvsim", *args]
        env["PYTHONPATH"] = str(ROOT)
    else:
        command = [sys.executable, "-c", EDITABLE, *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.strip() == "out" and (tmp_path / "out" / "report.md").exists()
    assert f"kvsim {__version__}" in (tmp_path / "out" / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvsim", "out"]  # no units left
