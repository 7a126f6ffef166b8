"""Replaying recorded query/key/value vectors (the ``trace`` source)."""

import numpy as np
import pytest
from policy_checks import SMALL_PARAMS

import kvsim
from kvsim.numerics.field import dense_field
from kvsim.policies import POLICIES
from kvsim.protocols.run import field_provides, make_group, resolve_params, run_policy

L, H, H_KV, T, D = 2, 4, 2, 40, 8

SCENARIO = """\
[attention]
source = "trace"
path = "trace.npz"
{extra}
[policies.h2o]
[policies.window]
[[experiment]]
prompt_len = 20
budgets = [8]
"""



def write_trace(folder, **drop):
    rng = np.random.default_rng(5)
    arrays = {"queries": rng.standard_normal((L, H, T, D)).astype(np.float16),
              "keys": rng.standard_normal((L, H_KV, T, D)).astype(np.float16),
              "values": rng.standard_normal((L, H_KV, T, D)).astype(np.float16),
              "layers": np.array([3, 11])}
    for name in drop:
        arrays.pop(name)
    np.savez(folder / "trace.npz", **arrays)
    return arrays


def dense_twin(arrays, layer_index, kv_ids, T_used):
    """Causal softmax of q . k / sqrt(d) in NumPy, float64, per selected query head."""
    group = H // H_KV
    heads = [kv * group + g for kv in kv_ids for g in range(group)]
    q = arrays["queries"][layer_index, heads, :T_used].astype(np.float64)
    k = arrays["keys"][layer_index, kv_ids, :T_used].astype(np.float64)
    logits = np.einsum("hqd,hkd->hqk", q, np.repeat(k, group, axis=0)) / np.sqrt(D)
    logits = np.where(np.tri(T_used, dtype=bool), logits, -np.inf)
    p = np.exp(logits - logits.max(axis=2, keepdims=True))
    return p / p.sum(axis=2, keepdims=True)


@pytest.mark.parametrize("extra, layer_index, kv_ids, T_used", [
    ("", 0, [0, 1], T),
    ("layer = 11\nkv_head_ids = [1]\nT = 32", 1, [1], 32),
])
def test_replay_matches_the_dense_softmax(tmp_path, extra, layer_index, kv_ids, T_used):
    arrays = write_trace(tmp_path)
    (tmp_path / "s.toml").write_text(SCENARIO.format(extra=extra))
    scenario = kvsim.load_scenario(tmp_path / "s.toml")
    assert (scenario.T, scenario.heads, scenario.kv_heads) == (T_used, 2 * len(kv_ids), len(kv_ids))
    field = scenario.field(0).data
    twin = dense_field(dense_twin(arrays, layer_index, kv_ids, T_used), len(kv_ids))._replace(
        keys=field.keys, queries=field.queries, qk_scale=field.qk_scale)  # for the policies reading them
    none = np.zeros((field.heads, T_used), bool)
    for kv in range(len(kv_ids)):
        for P in (0, 20, T_used):
            a = make_group(field, kv, P, none, {})
            b = make_group(twin, kv, P, none, {})
            for name, policy in POLICIES.items():
                if policy.needs - field_provides(twin, kv):
                    continue
                params = resolve_params(policy, SMALL_PARAMS.get(name, {}))
                ta, tb = run_policy(policy, a, 8, params), run_policy(policy, b, 8, params)
                assert np.allclose(ta.mass, tb.mass, rtol=0, atol=1e-9), name
                assert np.array_equal(ta.kept, tb.kept), name
                assert np.isfinite(ta.error).all() and np.isnan(tb.error).all()


def test_replay_runs_end_to_end(tmp_path):
    write_trace(tmp_path)
    (tmp_path / "s.toml").write_text(SCENARIO.format(extra=""))
    out = kvsim.run(tmp_path / "s.toml", tmp_path / "r")
    text = (out / "report.md").read_text()
    assert "`trace`" in text and "output error" in text.lower()


@pytest.mark.parametrize("extra, drop, expected", [
    ("layer = 4", {}, "attention.layer: expected one of the recorded layers [3, 11], got 4"),
    ("T = 41", {}, "attention.T: expected at most the recorded 40 tokens, got 41"),
    ("kv_head_ids = [2]", {}, "attention.kv_head_ids: expected distinct KV heads in [0, 2)"),
    ("", {"keys": 1}, "attention.path: expected an array 'keys' in trace.npz"),
])
def test_trace_problems(tmp_path, extra, drop, expected):
    write_trace(tmp_path, **drop)
    (tmp_path / "s.toml").write_text(SCENARIO.format(extra=extra))
    with pytest.raises(kvsim.ScenarioError) as info:
        kvsim.load_scenario(tmp_path / "s.toml")
    assert any(line.split(": ", 1)[1].startswith(expected) for line in info.value.lines()), \
        info.value.lines()
