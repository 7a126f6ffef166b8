"""Study reports that fail after their model runs: the results stay, one line says how to
finish the report; intervals that hold their estimate; the single-worker progress bar."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvsim.cli import main  # noqa: E402
from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.tools.task.report import KEPT, wilson  # noqa: E402
from test_task import CharTokenizer, task_config, tiny_net  # noqa: E402


def test_wilson_interval_holds_the_proportion():
    for n in range(1, 401):
        for k in range(n + 1):
            lo, hi = wilson(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n, lo, hi)
        assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0


def test_one_worker_with_a_progress_bar_that_redraws(monkeypatch):
    """tqdm's update() returns True when it redraws: once, that was taken for a trial's rows."""
    from tqdm import tqdm

    import kvsim.tools.task.command as command

    monkeypatch.setattr(command, "tqdm", functools.partial(tqdm, mininterval=0, miniters=1))
    cfg = task_config([PolicyConfig("window", "window", {})], budgets=(8,))
    cfg = type(cfg)(**{**vars(cfg), "trials": 2, "lengths": (300,)})
    rows = command.run_all(cfg, tiny_net(512), CharTokenizer(), workers=1, progress=True)
    assert len(rows) == 2 * (1 + 2) and {r["trial"] for r in rows} == {0, 1}


def _tiny_model(module, tmp_path, monkeypatch, capsys) -> None:
    """``module.load_model`` gives the tiny Llama and the character tokenizer, whose
    config and weights are saved as ``tmp_path / "m"`` (the load-time check reads them)."""
    monkeypatch.setattr(module, "load_model",
                        lambda model, gguf=None: (tiny_net(512), CharTokenizer()))
    tiny_net(512).save_pretrained(tmp_path / "m")
    capsys.readouterr()


def _broken_figures(*args, **kwargs):
    raise ValueError("'yerr' must not contain\nnegative values")


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def _beside(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_a_task_report_whose_figures_fail_keeps_its_results(tmp_path, monkeypatch, capsys):
    import kvsim.models.capture
    import kvsim.tools.task.report as report

    _tiny_model(kvsim.models.capture, tmp_path, monkeypatch, capsys)
    task, out = tmp_path / "t.toml", tmp_path / "r"
    task.write_text('name = "tiny"\n[task]\nmodel = "m"\nlengths = [300]\ndepths = [0.0, 1.0]\n'
                    'trials = 1\nbudgets = [8, 12]\n[policies.window]\n')
    monkeypatch.setattr(report, "_figures", _broken_figures)
    assert main(["task", str(task), "--out", str(out), "--quiet"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"kvsim: {out}: writing the report failed (ValueError: 'yerr' must "
                           f"not contain negative values); its results are kept "
                           f"({', '.join(KEPT)}): draw")
    assert line.endswith(f"`python -m kvsim task {task} --out {out} --redraw`")
    assert sorted(p.name for p in out.iterdir()) == sorted(KEPT)
    assert _beside(tmp_path) == ["m", "r", "t.toml"]
    results = (out / "results.csv").read_bytes()
    assert results.count(b"\n") == 1 + 2 * (1 + 2 * 2)

    # A redraw that fails leaves the folder as it was; the advised one then draws the report.
    assert main(["task", str(task), "--out", str(out), "--redraw"]) == 2
    assert _one_line(capsys).endswith("; no report written (the earlier one is unchanged)")
    assert sorted(p.name for p in out.iterdir()) == sorted(KEPT)
    monkeypatch.undo()
    assert main(["task", str(task), "--out", str(out), "--redraw"]) == 0
    assert (out / "report.md").is_file() and (out / "results.csv").read_bytes() == results
    assert _beside(tmp_path) == ["m", "r", "t.toml"]


def test_a_closed_loop_report_whose_figures_fail_keeps_its_results(tmp_path, monkeypatch,
                                                                   capsys):
    import kvsim.tools.closed_loop.command as command
    import kvsim.tools.closed_loop.report as report

    _tiny_model(command, tmp_path, monkeypatch, capsys)
    study, out = tmp_path / "c.toml", tmp_path / "r"
    study.write_text('name = "tiny"\n[closed_loop]\nmodel = "m"\ntext = "gpl-3"\ntokens = 40\n'
                     'prompt_len = 24\nbudgets = [8, 12]\n[policies.window]\n')
    real_figures = report._figures
    monkeypatch.setattr(report, "_figures", _broken_figures)
    assert main(["closed-loop", str(study), "--out", str(out), "--quiet"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"kvsim: {out}: writing the report failed (ValueError: ")
    assert line.endswith(f"--out {out} --redraw`")
    assert sorted(p.name for p in out.iterdir()) == sorted(report.KEPT)
    assert _beside(tmp_path) == ["c.toml", "m", "r"]
    results = (out / "results.csv").read_bytes()
    monkeypatch.setattr(report, "_figures", real_figures)
    assert main(["closed-loop", str(study), "--out", str(out), "--redraw"]) == 0  # the advice
    assert (out / "report.md").is_file() and (out / "results.csv").read_bytes() == results
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*report.KEPT, "predictors.csv", "report.md", "scatter_mass_vs_kl.png",
         "kl_over_steps.png"])
    assert main(["closed-loop", str(study), "--out", str(out), "--quiet"]) == 0  # replaced
    assert (out / "report.md").is_file() and _beside(tmp_path) == ["c.toml", "m", "r"]
    csvs = {name: (out / name).read_bytes() for name in
            ("results.csv", "steps.csv", "predictors.csv")}
    assert main(["closed-loop", str(study), "--out", str(out), "--redraw"]) == 0
    assert {name: (out / name).read_bytes() for name in csvs} == csvs  # byte for byte
