"""The on-demand trace cache: damaged files are captured again, an unwritable cache
folder is skipped, captures land in one rename."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from broken import broken_deflate, cli
from fake_capture import fake_model, use_fake_capture

from kvsim.attention import trace_cache
from kvsim.scenario.load import load_scenario
from kvsim.models import capture, preflight


@pytest.fixture
def setup(tmp_path, monkeypatch):
    calls: list = []
    use_fake_capture(monkeypatch, calls)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(trace_cache, "_UNCACHED", {})
    fake_model(tmp_path / "model")
    (tmp_path / "text.txt").write_text("some text")
    (tmp_path / "s.toml").write_text(
        '[attention]\nsource = "trace"\nmodel = "model"\ntext = "text.txt"\ntokens = 32\n'
        'layers = "all"\n[policies.tova]\n[[experiment]]\nprompt_len = 20\nbudgets = [8]\n')
    return tmp_path, calls


def cached(tmp_path):
    return sorted((tmp_path / "cache" / "kvsim" / "traces").glob("*.npz"))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the stored (uncompressed) array data
    path.write_bytes(bytes(data))


def reshape(path):
    rng = np.random.default_rng(0)
    np.savez(path, queries=rng.standard_normal((2, 4, 16, 8)),
             keys=rng.standard_normal((2, 2, 16, 8)), layers=np.array([0, 1]))


def empty(path):
    path.write_bytes(b"")


def inflate(path):
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    broken_deflate(path, arrays, "keys", 0.5)  # compressed, as captures are


CAPTURE = "capturing every layer of model on text.txt (32 tokens)"


@pytest.mark.parametrize("damage, reason", [
    (truncate, "File is not a zip file"), (flip, "queries.npy fails its checksum"),
    (reshape, "queries of shape (2, 4, 16, 8), expected (layers, heads, 32, dim)"),
    (empty, "File is not a zip file"),
    (inflate, "Error -3 while decompressing data: invalid block type")])
def test_a_damaged_cached_trace_is_captured_again(setup, capsys, damage, reason):
    tmp_path, calls = setup
    load_scenario(tmp_path / "s.toml")
    (path,) = cached(tmp_path)
    good = path.read_bytes()
    damage(path)
    capsys.readouterr()
    scenario = load_scenario(tmp_path / "s.toml")
    assert capsys.readouterr().err.splitlines() == [
        f"kvsim: the cached trace {path} is unusable ({reason}); {CAPTURE} into {path} (once)"]
    assert len(calls) == 2 and path.read_bytes() == good and scenario.T == 32
    assert trace_cache.damage(path, 32) is None


def test_validate_with_a_damaged_cached_trace_prints_one_notice(setup):
    tmp_path, calls = setup
    load_scenario(tmp_path / "s.toml")
    (path,) = cached(tmp_path)
    inflate(path)
    status, out, err = cli(["validate", tmp_path / "s.toml"])
    assert status == 0 and "ok" in out and len(calls) == 2
    assert err.splitlines() == [f"kvsim: the cached trace {path} is unusable (Error -3 while "
                                f"decompressing data: invalid block type); {CAPTURE} into "
                                f"{path} (once)"]


def test_without_the_capture_extra_a_trace_to_capture_is_one_error(setup, monkeypatch):
    tmp_path, calls = setup
    load_scenario(tmp_path / "s.toml")
    (path,) = cached(tmp_path)
    flip(path)
    damaged = path.read_bytes()
    monkeypatch.setattr(preflight, "missing_extra", lambda gguf: ["torch", "transformers"])
    for argv in (["validate", tmp_path / "s.toml"], [tmp_path / "s.toml", "--quiet", "--out",
                                                      tmp_path / "r"]):
        status, out, err = cli(argv)
        assert status == 2 and out == "" and err.splitlines() == [
            f"{tmp_path / 's.toml'}: attention.model: expected the capture extra "
            f"({preflight.INSTALL}) to capture every layer of model on text.txt (32 tokens), "
            f"as the cached trace {path} is unusable (queries.npy fails its checksum); "
            f"missing: torch, transformers"]
    assert len(calls) == 1 and path.read_bytes() == damaged and not (tmp_path / "r").exists()


def test_an_unwritable_cache_folder_is_skipped_with_a_note(setup, capsys, monkeypatch):
    tmp_path, calls = setup
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    scenario = load_scenario(tmp_path / "s.toml")
    (err,) = capsys.readouterr().err.splitlines()
    folder = tmp_path / "cache" / "kvsim" / "traces"
    assert err.startswith(f"kvsim: the trace cache {folder} cannot be written (Not a "
                          f"directory); {CAPTURE} into ") and err.endswith(", removed at exit")
    assert scenario.T == 32 and len(calls) == 1
    assert calls[0][0] == os.path.realpath(tmp_path / "model")  # the model, not the cache
    load_scenario(tmp_path / "s.toml")
    assert len(calls) == 1  # captured once per process


class Unsearchable(type(Path())):
    """A path in a folder that cannot be searched (root reads any folder: simulated)."""

    def is_file(self):
        raise PermissionError(13, "Permission denied", str(self))


def test_an_unreadable_cache_folder_is_skipped_with_a_note(setup, capsys, monkeypatch):
    tmp_path, calls = setup
    folder = Unsearchable(tmp_path / "cache" / "kvsim" / "traces")
    monkeypatch.setattr(trace_cache, "cache_folder", lambda: folder)
    scenario = load_scenario(tmp_path / "s.toml")
    (err,) = capsys.readouterr().err.splitlines()
    assert err.startswith(f"kvsim: the trace cache {folder} cannot be read (Permission "
                          f"denied); {CAPTURE} into ") and err.endswith(", removed at exit")
    assert scenario.T == 32 and len(calls) == 1 and not (tmp_path / "cache").exists()
    assert calls[0][0] == os.path.realpath(tmp_path / "model")
    status, out, err = cli([tmp_path / "s.toml", "--quiet", "--out", tmp_path / "r"])
    assert status == 0 and err == "" and len(calls) == 1  # the same capture, this process


def test_a_capture_lands_in_one_rename(tmp_path, monkeypatch):
    """Two runs capturing the same trace each write their own temporary file and rename
    it: a reader sees no file or a whole one."""
    monkeypatch.setattr(capture, "load_model", lambda model, gguf: (None, lambda raw: {
        "input_ids": list(range(len(raw.split())))}))
    monkeypatch.setattr(capture, "record", lambda net, ids, layers, dtype: {
        "layers": np.array([0]), "windows": np.array([0]),
        "queries": np.zeros((1, 2, len(ids), 4), dtype),
        "keys": np.zeros((1, 1, len(ids), 4), dtype)})
    moves = []
    real = capture.os.replace
    monkeypatch.setattr(capture.os, "replace",
                        lambda src, dst: moves.append((src, dst, dst.exists())) or real(src, dst))
    (tmp_path / "t.txt").write_text("one two three four five six")
    out = tmp_path / "c" / "trace.npz"
    capture.capture("m", tmp_path / "t.txt", 6, out)
    ((src, dst, existed),) = moves
    assert dst == out and not existed and src.parent == out.parent and src.name.startswith(".")
    assert not src.exists() and trace_cache.damage(out, 6) is None
