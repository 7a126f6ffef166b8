"""Every path kvsim reads or writes, when it is not what it should be: a folder, a FIFO,
/dev/zero, bytes that are not UTF-8 or not an array, a symlink loop, a name too long.
One line naming the file and the key, exit 2, no hang, nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.report import writer

OK = '[attention]\nsource = "field"\nT = 32\n[policies.window]\n[[experiment]]\nbudgets = [4]\nfigures = []\n'


def make(tmp_path: Path, kind: str) -> Path:
    """A path of ``kind`` in ``tmp_path``."""
    p = tmp_path / "thing"
    if kind == "folder":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev-zero":
        return Path("/dev/zero")
    elif kind == "not-utf8":
        p.write_bytes(b"\xff\xfe\x00bad")
    elif kind == "loop":
        p.symlink_to(p)
    elif kind == "too-long":
        return tmp_path / ("x" * 300)
    return p


KINDS = {"folder": "a folder, not a file", "fifo": "not a regular file",
         "dev-zero": "not a regular file", "not-utf8": "not UTF-8 (byte 0)",
         "loop": "Too many levels of symbolic links", "too-long": "File name too long"}


def one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", [["validate"], ["--out", "r"], ["closed-loop", "--out", "r"]])
def test_scenario_paths(tmp_path, capsys, monkeypatch, kind, command):
    monkeypatch.chdir(tmp_path)
    path = make(tmp_path, kind)
    assert main([*command[:1], str(path), *command[1:]] if command[0] == "closed-loop"
                else [str(path), *command] if command[0] == "--out"
                else [*command, str(path)]) == 2
    assert one_line(capsys) == f"{path}: expected a readable UTF-8 text file ({KINDS[kind]})"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["matrix", "trace"])
def test_matrix_and_trace_paths(tmp_path, capsys, kind, source):
    path = make(tmp_path, kind)
    (tmp_path / "s.toml").write_text(f'[attention]\nsource = "{source}"\npath = "{path}"\n'
                                     f'[policies.window]\n[[experiment]]\nbudgets = [4]\n')
    assert main(["validate", str(tmp_path / "s.toml")]) == 2
    err = one_line(capsys)
    assert err.startswith(f"{tmp_path / 's.toml'}: attention.path: expected ")
    if kind == "not-utf8":  # a regular file that is no array file
        assert "expected a readable .npy or .npz file" in err
    else:
        assert f"({KINDS[kind]})" in err


@pytest.mark.parametrize("kind", KINDS)
def test_trace_cache_texts(tmp_path, capsys, kind, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = make(tmp_path, kind)
    (tmp_path / "s.toml").write_text(
        f'[attention]\nsource = "trace"\nmodel = "SmolLM2-135M-Instruct"\ntext = "{path}"\n'
        f'tokens = 8\n[policies.window]\n[[experiment]]\nbudgets = [4]\n')
    assert main(["validate", str(tmp_path / "s.toml")]) == 2
    assert one_line(capsys) == (f"{tmp_path / 's.toml'}: attention.text: expected a readable "
                                f"UTF-8 text file ({KINDS[kind]})")
    assert not (tmp_path / "cache").exists()


def test_out_inside_a_file(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(OK)
    (tmp_path / "f").write_text("a file")
    assert main([str(tmp_path / "s.toml"), "--out", str(tmp_path / "f" / "r"), "--quiet"]) == 2
    assert one_line(capsys) == (f"kvsim: {tmp_path / 'f' / 'r'}: expected a folder path, got "
                                f"one inside the file {tmp_path / 'f'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "s.toml"]


def test_out_in_a_read_only_folder(tmp_path, capsys, monkeypatch):
    (tmp_path / "s.toml").write_text(OK)
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(writer.os, "access", lambda p, mode: False if Path(p) == tmp_path / "ro"
                        else real(p, mode))  # as if read-only (root ignores permissions)
    assert main([str(tmp_path / "s.toml"), "--out", str(tmp_path / "ro" / "r"), "--quiet"]) == 2
    assert one_line(capsys) == (f"kvsim: {tmp_path / 'ro' / 'r'}: expected a folder kvsim can "
                                f"write in, got {tmp_path / 'ro'} (read-only)")
    assert list((tmp_path / "ro").iterdir()) == []


def test_an_earlier_report_kvsim_cannot_remove_is_refused_before_any_work(tmp_path, capsys,
                                                                         monkeypatch):
    """Replaced, a read-only report could not be removed: it stayed beside the new one as
    ``.r.old-PID``. Now the run refuses it first, in one line, and leaves it as it was."""
    import json

    (tmp_path / "s.toml").write_text(OK)
    out = tmp_path / "r"
    assert main([str(tmp_path / "s.toml"), "--out", str(out), "--quiet"]) == 0
    (out / "sub").mkdir()
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    real = os.access
    monkeypatch.setattr(writer.os, "access", lambda p, mode: False if Path(p) == out / "sub"
                        else real(p, mode))  # as if read-only (root ignores permissions)
    assert main([str(tmp_path / "s.toml"), "--out", str(out), "--quiet"]) == 2
    assert one_line(capsys) == (f"kvsim: {out}: expected a report kvsim can replace, got the "
                                f"read-only folder {out / 'sub'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "s.toml"]
    assert sorted(p.name for p in out.iterdir()) == before
    study = tmp_path / "study"  # a closed-loop (or task) report of the same study
    (study / "sub").mkdir(parents=True)
    (study / "closed_loop.json").write_text(json.dumps({"settings": {"name": "a"}}))
    monkeypatch.setattr(writer.os, "access", lambda p, mode: Path(p) != study / "sub")
    with pytest.raises(KvsimError, match="expected a report kvsim can replace"):
        writer.check_study_out(study, False, "closed_loop.json", "a", "closed-loop")


def test_out_with_a_name_too_long(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(OK)
    out = tmp_path / ("y" * 300) / "r"
    assert main([str(tmp_path / "s.toml"), "--out", str(out), "--quiet"]) == 2
    assert one_line(capsys) == f"kvsim: {out}: expected a usable folder path (File name too long)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]
