"""Closed-loop files: everything checkable is checked before torch is imported, one line
per problem, exit 2; ``validate`` accepts them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.models import preflight

ROOT = Path(__file__).parents[1]
TEXT = "The quick brown fox jumps over the lazy dog. " * 20  # 900 bytes


def write(tmp_path: Path, closed_loop: str = "", policies: str = "[policies.window]\n",
          text: str | bytes | None = TEXT) -> Path:
    if isinstance(text, str):
        (tmp_path / "t.txt").write_text(text)
    elif isinstance(text, bytes):
        (tmp_path / "t.txt").write_bytes(text)
    path = tmp_path / "c.toml"
    path.write_text(f'name = "c"\n[closed_loop]\ntext = "t.txt"\ntokens = 64\n'
                    f'prompt_len = 48\nbudgets = [16, 32]\n{closed_loop}\n{policies}')
    return path


def run_before_torch(*args) -> tuple[int, str, str]:
    """The command in a fresh process, which fails if torch was imported."""
    code = ("import sys\nfrom kvsim.cli import main\nstatus = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_validate_accepts_a_closed_loop_file(tmp_path, capsys):
    path = write(tmp_path)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: ok (closed-loop file: 1 policies x 2 budgets, tokens = 64")
    assert main(["validate", str(path), "--seeds", "0:2"]) == 2
    assert "--seeds: expected only with scenario files, got a [closed_loop] file" in \
        capsys.readouterr().err


def test_shipped_closed_loop_files_validate(capsys):
    for name in ("closed_loop_smollm2_short.toml", "closed_loop_smollm2.toml"):
        assert main(["validate", str(ROOT / "scenarios" / name)]) == 0, capsys.readouterr().err


def test_snapkv_without_protect_window_fails_before_the_model(tmp_path):
    path = write(tmp_path, policies="[policies.snap]\nkind = \"snapkv\"\nwindow = 8\n"
                                    "protect_window = false\n")
    for command in (["closed-loop", path, "--out", tmp_path / "r"], ["validate", path]):
        status, stdout, stderr = run_before_torch(*command)
        assert (status, stdout) == (2, "")
        assert stderr == (f"{path}: policies.snap.protect_window: expected true when there "
                          f"are decode steps (prompt_len 48 < T 64), got false\n")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text, message", [
    ("short text", "closed_loop.tokens: expected at most the text's tokens, got 64 for a "
                   "text of 10 bytes (a token covers at least one byte)"),
    (b"\xff\xfe not utf-8" * 20, "closed_loop.text: expected a readable UTF-8 text file, "
                                 "got '{text}' (not UTF-8 (byte 0))"),
    ("folder", "closed_loop.text: expected a readable UTF-8 text file, got '{text}' "
               "(a folder, not a file)"),
    ("fifo", "closed_loop.text: expected a readable UTF-8 text file, got '{text}' "
             "(not a regular file)"),
])
def test_unusable_texts_are_one_line(tmp_path, text, message):
    if text == "folder":
        (tmp_path / "t.txt").mkdir()
    elif text == "fifo":
        os.mkfifo(tmp_path / "t.txt")  # opening it would block
    path = write(tmp_path, text=None if text in ("folder", "fifo") else text)
    status, stdout, stderr = run_before_torch("closed-loop", path, "--out", tmp_path / "r")
    want = message.format(text=(tmp_path / "t.txt").resolve())
    assert (status, stdout, stderr) == (2, "", f"{path}: {want}\n")


def test_model_folders_without_config_or_weights(tmp_path):
    (tmp_path / "m").mkdir()
    path = write(tmp_path, 'model = "m"')
    status, _, stderr = run_before_torch("validate", path)
    assert status == 2 and stderr == (f"{path}: closed_loop.model: expected a model folder "
                                      f"with config.json, got '{tmp_path / 'm'}'\n")
    (tmp_path / "m" / "config.json").write_text("{}")
    status, _, stderr = run_before_torch("validate", path)
    assert status == 2 and "closed_loop.model: expected a model folder with weights" in stderr


def test_every_problem_is_its_own_line(tmp_path):
    path = write(tmp_path, 'model = "nowhere"', text="tiny",
                 policies='[policies.oracle]\n[policies.snap]\nkind = "snapkv"\n'
                          'protect_window = false\n')
    status, stdout, stderr = run_before_torch("closed-loop", path)
    keys = [line.split(": ")[1] for line in stderr.splitlines()]
    assert status == 2 and stdout == ""
    assert keys == ["closed_loop.model", "closed_loop.tokens", "policies.oracle",
                    "policies.snap.protect_window"]


def test_a_missing_capture_extra_is_named(tmp_path, monkeypatch, capsys):
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "gguf") else real(name, *a))
    assert main(["validate", str(write(tmp_path))]) == 2
    assert capsys.readouterr().err.endswith(
        "closed_loop: expected the capture extra (without a GPU, pip install torch "
        "--index-url https://download.pytorch.org/whl/cpu first; then pip install -e "
        '".[capture]"); missing: torch, gguf\n')


FAMILIES = "llama, gemma3_text, qwen2, qwen3, mistral, phi3"
UNSUPPORTED = f"expected a model of a family kvsim supports ({FAMILIES}), got "


def model_folder(tmp_path: Path, config: str | None, gguf: str | None = None) -> Path:
    """A model folder with ``config`` as its config.json and empty weights, or a GGUF file
    whose header names the architecture ``gguf``: nothing a model could load from."""
    from fake_capture import fake_gguf

    folder = tmp_path / "m"
    folder.mkdir()
    if gguf:
        fake_gguf(folder / "w.gguf", gguf)
    else:
        (folder / "config.json").write_text(config)
        (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize("config, gguf, problem", [
    ('{"model_type": "gpt2"}', None, UNSUPPORTED + "'gpt2' (config.json's model_type)"),
    ('{"model_type": "gemma3"}', None,  # the multimodal Gemma-3: its layers are elsewhere
     UNSUPPORTED + "'gemma3' (config.json's model_type)"),
    ('{"architectures": ["LlamaForCausalLM"]}', None,
     f"expected a model whose family kvsim can read (config.json's model_type: one of "
     f"{FAMILIES}), got none"),
    ("", "gpt2", UNSUPPORTED + "'gpt2' (w.gguf's general.architecture)"),
    ('{"model_type": "qwen3", "layer_types": ["full_attention", "linear_attention"]}', None,
     "expected layer types kvsim runs (full_attention, sliding_attention) in "
     "config.layer_types, got 'linear_attention'"),
])
def test_a_model_of_a_family_kvsim_does_not_support_is_refused_before_torch(
        tmp_path, config, gguf, problem):
    pytest.importorskip("gguf")
    model_folder(tmp_path, config, gguf)
    path = write(tmp_path, 'model = "m"' + ('\ngguf_file = "w.gguf"' if gguf else ""))
    for command in (["validate", path], ["closed-loop", path, "--out", tmp_path / "r"]):
        assert run_before_torch(*command) == (2, "", f"{path}: closed_loop.model: {problem}\n")
    assert not (tmp_path / "r").exists()


def test_capture_and_on_demand_traces_refuse_an_unsupported_family_before_torch(tmp_path):
    model_folder(tmp_path, '{"model_type": "gpt2"}')
    (tmp_path / "t.txt").write_text(TEXT)
    status, out, err = run_before_torch("capture", "--model", tmp_path / "m", "--text",
                                        tmp_path / "t.txt", "--out", tmp_path / "x.npz")
    assert (status, out) == (2, "") and err.splitlines() == [
        f"kvsim: --model: {UNSUPPORTED}'gpt2' (config.json's model_type)"], err
    scenario = tmp_path / "s.toml"
    scenario.write_text('[attention]\nsource = "trace"\nmodel = "m"\ntext = "t.txt"\n'
                        'tokens = 32\n[policies.tova]\n[[experiment]]\nbudgets = [8]\n')
    assert run_before_torch("validate", scenario) == (
        2, "", f"{scenario}: attention.model: {UNSUPPORTED}'gpt2' (config.json's model_type)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "s.toml", "t.txt"]


def test_the_named_models_are_of_supported_families():
    from kvsim.models import catalog

    for name in catalog.PRESETS:
        try:
            folder, gguf = catalog.resolve(name)
        except Exception:  # its wheel is not installed
            continue
        assert catalog.family(folder, gguf) in catalog.FAMILIES and \
            catalog.family_problem(folder, gguf) is None, name


def test_a_press_without_the_kvpress_extra_is_one_line(tmp_path, capsys, monkeypatch):
    """A closed-loop ``[policies.NAME]`` table with a ``press`` key is kvpress's press: without
    the extra, ``validate`` refuses it in one line saying how to install it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "kvpress" else real(name, *a))
    path = write(tmp_path, policies='[policies.window]\n[policies.snap]\npress = "SnapKVPress"\n')
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"{path}: policies.snap.press: expected the kvpress extra: pip "
                           f'install -e ".[capture,kvpress]"'), line
