"""Studies as plug-ins on one base (kvsim/tools/study/): the command line is built from the
table of study types, and no study package imports another's modules or a private name of
another package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.tools.study.types import BUILT_IN, studies

TOOLS = Path(__file__).resolve().parents[1] / "kvsim" / "tools"


def _imports(path: Path):
    """(module, names) of every ``from ... import`` and ``import`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


@pytest.mark.parametrize("package", BUILT_IN)
def test_a_study_package_imports_no_other_study_and_no_private_name(package):
    others = [f"kvsim.tools.{p}" for p in BUILT_IN if p != package]
    for path in sorted((TOOLS / package).glob("*.py")):
        for module, names in _imports(path):
            assert not any(module == o or module.startswith(o + ".") for o in others), \
                f"{path.name} imports {module}"
            if module.startswith("kvsim.") and not module.startswith(f"kvsim.tools.{package}"):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{path.name} imports {private} from {module}"


def test_the_command_line_lists_and_runs_every_study_type_of_the_table(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command, study in studies().items():
        assert f"  kvsim {command} FILE.toml" in text
        with pytest.raises(SystemExit):
            main([command, "--help"])
        own = capsys.readouterr().out
        assert own.startswith(f"usage: kvsim {command}") and "--out" in own
        assert ("--redraw" in own) == (study.redraw is not None)
        assert ("--gate" in own) == (study.gate is not None)


def test_validate_tells_a_study_file_by_its_table_and_refuses_scenario_overrides(tmp_path,
                                                                             capsys):
    path = tmp_path / "c.toml"
    path.write_text('name = "c"\n[closed_loop]\nmodel = "nowhere"\nbudgets = [8]\n'
                    '[policies.window]\n')
    assert main(["validate", str(path), "--budgets", "8"]) == 2
    assert capsys.readouterr().err == ("kvsim: --budgets: expected only with scenario "
                                       "files, got a [closed_loop] file\n")
    assert main(["validate", str(path)]) == 2
    assert "closed_loop.model: expected a model folder" in capsys.readouterr().err


def ticking(item: tuple) -> int:
    """A job that counts ``n`` ticks, waits ``pause`` seconds and returns ``10 n``."""
    import time

    from kvsim.tools.study.job import tick

    n, pause = item
    for _ in range(n):
        tick(1)
    time.sleep(pause)
    return 10 * n


class Bar:
    """A progress bar that records its updates."""

    def __init__(self):
        self.updates = []

    def update(self, n: int = 1) -> None:
        self.updates.append(n)


def test_forked_jobs_tick_the_bar_to_its_total():
    from kvsim.tools.study.workers import forked_map

    items = [(n, 0.0) for n in range(1, 9)]
    for workers in (1, 2):  # each job returns at once: its last ticks may still be on the way
        bar = Bar()
        assert forked_map(ticking, items, workers, (), bar, lambda item: item[0]) == \
            [10 * n for n in range(1, 9)]
        assert sum(bar.updates) == 36, workers


def _dies(item: int) -> int:
    if item == 3:
        import os
        os._exit(1)  # as the out-of-memory killer ends a worker
    return item


def test_a_worker_killed_mid_run_is_one_line_of_the_machine():
    """A worker that the system kills (the OOM killer ended one in a 2,048-token task run)
    was a BrokenProcessPool traceback; it is an OSError the command line prints as one
    line (exit 1)."""
    from kvsim.forked import WorkerLost
    from kvsim.tools.study.workers import forked_map

    with pytest.raises(WorkerLost, match=r"^a worker process of 2 ended abruptly \(killed, "
                                         r"most often by the system for want of memory\)"):
        forked_map(_dies, range(6), 2, ())
    assert issubclass(WorkerLost, OSError)

