"""One run check (kvsim.protocols.run.run_problems) for every way into a run: the scenario
loader, the Python API, the Stepper and the study files (closed loop, task), which refuse
a protocol before any model loads."""

from __future__ import annotations

import numpy as np
import pytest
from test_closed_loop_checks import run_before_torch, write

import kvsim
from kvsim.errors import KvsimError
from kvsim.policies import POLICIES
from kvsim.protocols.run import resolve_params, run_problems
from kvsim.protocols.stepping import Stepper

PROTOCOL = ("expected the per-step rule or a protocol a model steps (page, heads; a policy "
            "stepped one token at a time takes no other), got {}: the others are the "
            "simulator's")


def attention(T: int) -> np.ndarray:
    A = np.tril(np.random.default_rng(T).random((T, T)) + 0.1)
    return A / A.sum(axis=1, keepdims=True)


def test_run_problems_gives_every_problem_in_order():
    rule = POLICIES["expected_attention"]
    params = resolve_params(rule, {"n_sink": 8, "page": 2})
    found = run_problems(rule, params, [3, 12, 2], T=16, prompt_len=8)
    assert [(p.kind, p.key, p.budget) for p in found] == [
        ("budget", "", 0), ("protocol", "page", 1), ("budget", "", 2),
        ("policy", "n_sink", None)]
    assert [p.kind for p in run_problems(rule, params, [3, 12, 2])] == ["budget", "budget"]
    h2o = POLICIES["h2o"]
    params = resolve_params(h2o, {"accumulate": "full", "interval": 4})
    found = run_problems(h2o, params, [8], T=16, prompt_len=8, stepping=True)
    assert [(p.kind, p.key) for p in found] == [("stepping", "interval"), ("stepping", "")]
    assert found[0].message == PROTOCOL.format("interval=4")


def test_the_api_and_the_stepper_name_the_parameter_of_a_policy_check():
    """Both said ``snapkv.Problem(key=..., message=...)`` before they shared the check."""
    A = attention(12)
    message = ("snapkv.protect_window: expected true when there are decode steps "
               "(prompt_len 6 < T 12), got false")
    with pytest.raises(KvsimError) as err:
        kvsim.simulate(A, "snapkv", 8, 6, protect_window=False, window=2)
    assert str(err.value) == message
    with pytest.raises(KvsimError) as err:
        Stepper("snapkv", 8, {"protect_window": False, "window": 2},
                prompt_attention=A[None, :6, :6], capacity_T=12)
    assert str(err.value) == message


def test_stepping_takes_uniform_heads_alone_with_its_protocol_check():
    """heads = "uniform" and pages are stepped a layer at a time (UniformLayer), with the
    simulator's protocol check: a policy without scores to sum is refused as the simulator
    refuses it; another protocol beside them is refused."""
    h2o, window = POLICIES["h2o"], POLICIES["window"]
    for asked in ({"heads": "uniform"}, {"page": 2}, {"heads": "uniform", "page": 2}):
        assert run_problems(h2o, resolve_params(h2o, asked), [8], T=16, prompt_len=8,
                            stepping=True) == [], asked
    batched = resolve_params(h2o, {"interval": 2, "page": 2})
    assert [p.kind for p in run_problems(h2o, batched, [8], T=16, prompt_len=8,
                                         stepping=True)][0] == "stepping"
    big = resolve_params(h2o, {"page": 8})
    assert [(p.kind, p.key) for p in run_problems(h2o, big, [8], T=16, prompt_len=8,
                                                  stepping=True)] == [("protocol", "page")]
    found = run_problems(window, resolve_params(window, {"heads": "uniform"}), [8], T=16,
                         prompt_len=8, stepping=True)
    assert [(p.kind, p.key) for p in found] == [("protocol", "heads")]


def test_the_stepper_refuses_a_protocol_naming_its_setting():
    with pytest.raises(KvsimError) as err:
        Stepper("h2o", 8, {"interval": 4}, prompt_attention=np.ones((1, 1, 1)), capacity_T=4)
    assert str(err.value) == "h2o.interval: " + PROTOCOL.format("interval=4")


@pytest.mark.parametrize("caller", ["scenario", "api", "closed_loop", "task"])
def test_every_way_into_a_run_calls_the_one_check(monkeypatch, tmp_path, caller):
    """A problem that only run_problems knows of reaches each caller's error."""
    import importlib

    from kvsim.protocols.run import RunProblem

    def planted(*args, **kwargs):
        return [RunProblem("policy", "planted", "expected the planted problem")]

    for module in ("kvsim.api.simulate", "kvsim.scenario.load", "kvsim.tools.study.file"):
        monkeypatch.setattr(importlib.import_module(module), "run_problems", planted)
    if caller == "api":
        with pytest.raises(KvsimError, match="^window.planted: expected the planted problem$"):
            kvsim.simulate(attention(12), "window", 4, 6)
        return
    if caller == "scenario":
        path = tmp_path / "s.toml"
        path.write_text('[attention]\nsource = "field"\nT = 16\n[policies.window]\n'
                        '[[experiment]]\nbudgets = [4]\n')
        load = kvsim.load_scenario
    elif caller == "closed_loop":
        from kvsim.tools.closed_loop.config import load_config as load

        path = write(tmp_path)
    else:
        from kvsim.tools.task.config import load_config as load

        path = task_file(tmp_path, "")
    with pytest.raises(KvsimError, match="policies.window.planted: expected the planted"):
        load(path)


def task_file(tmp_path, policy: str, task: str = ""):
    """A task file on a model folder that passes the checks made before a model loads,
    its ``[task]`` continued by ``task`` and ``[policies.window]`` by ``policy``."""
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    path = tmp_path / "t.toml"
    path.write_text(f'name = "t"\n[task]\nmodel = "m"\nlengths = [128]\ndepths = [0.5]\n'
                    f'budgets = [16]\ntrials = 1\n{task}\n[policies.window]\n{policy}\n')
    return path


def test_a_task_that_widens_its_caches_needs_a_declared_layout(monkeypatch, tmp_path):
    """before_question and prefill_only widen each stepped cache for the question, by the
    policy's layout: a policy without one is refused before any model loads."""
    import dataclasses

    from kvsim.tools.task.config import load_config

    monkeypatch.setitem(POLICIES, "bare", dataclasses.replace(POLICIES["tova"], name="bare",
                                                              layout=None))
    path = task_file(tmp_path, "[policies.bare]")
    with pytest.raises(KvsimError) as err:
        load_config(path)
    assert err.value.problems == [(str(path), "policies.bare", (
        "expected a policy that can run in a closed loop; bare cannot: it declares no state "
        "layout (Policy.layout) to widen its cache by for the question"))]
    path = task_file(tmp_path, "[policies.bare]", 'compress = ["after_question"]')
    assert [p.label for p in load_config(path).policies] == ["window", "bare"]


@pytest.mark.parametrize("kind, setting, words", [
    ("closed_loop", "interval = 4", "interval=4"),
    ("closed_loop", "threshold = 0.1", "threshold=0.1/window=128"),
    ("task", 'question_len = 8\ncompress = "before_question"', "before_question(Q=8)"),
])
def test_validate_refuses_a_protocol_in_a_study_file_before_any_model(tmp_path, kind,
                                                                     setting, words):
    key = setting.split(" ")[0]
    if kind == "closed_loop":
        path = write(tmp_path, policies=f"[policies.window]\n{setting}\n")
        commands = (["validate", path], ["closed-loop", path, "--out", tmp_path / "r"])
    else:
        path = task_file(tmp_path, setting)
        commands = (["validate", path], ["task", path, "--out", tmp_path / "r"])
    for command in commands:
        status, stdout, stderr = run_before_torch(*command)
        assert (status, stdout) == (2, ""), stderr
        assert stderr == f"{path}: policies.window.{key}: {PROTOCOL.format(words)}\n"
    assert not (tmp_path / "r").exists()
