"""kvsim.npz.write_npz: np.load reads what it writes, the same arrays give the same bytes,
and an interrupt at any line of the write is that interrupt, never a second error (CI met
a ValueError from zipfile's close after a Ctrl-C in the report's write phase)."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

from kvsim.npz import write_npz

ARRAYS = {"a/x": np.arange(12.0).reshape(3, 4), "b": np.array([1, 2, 3], np.int32),
          "meta": np.array('{"k": 1}'), "empty": np.zeros((0, 5), np.float16)}


@pytest.mark.parametrize("level", [0, 1, 6])
def test_np_load_reads_the_arrays_and_the_same_arrays_give_the_same_bytes(tmp_path, level):
    write_npz(tmp_path / "one.npz", ARRAYS, level)
    write_npz(tmp_path / "two.npz", ARRAYS, level)
    assert (tmp_path / "one.npz").read_bytes() == (tmp_path / "two.npz").read_bytes()
    with np.load(tmp_path / "one.npz") as data:
        assert sorted(data.files) == sorted(ARRAYS)
        for name, value in ARRAYS.items():
            assert data[name].dtype == value.dtype
            np.testing.assert_array_equal(data[name], value)


def test_a_higher_level_writes_fewer_bytes(tmp_path):
    big = {"x": np.repeat(np.arange(50.0), 400)}
    sizes = []
    for level in (0, 1, 9):
        write_npz(tmp_path / f"{level}.npz", big, level)
        sizes.append((tmp_path / f"{level}.npz").stat().st_size)
    assert sizes[0] > sizes[1] >= sizes[2]


class _Interrupt:
    """A trace function raising KeyboardInterrupt at the ``at``-th line run anywhere below
    the call, as a signal handler would between two lines. Not inside a finalizer: an
    interrupt swallowed there is kvsim.interrupts' unraisable hook's case (test_interrupts)."""

    def __init__(self, at: int):
        self.at, self.seen = at, 0

    def __call__(self, frame, event, arg):
        if frame.f_code.co_name == "__del__":
            return None
        if event == "line":
            self.seen += 1
            if self.seen == self.at:
                raise KeyboardInterrupt
        return self


def test_an_interrupt_at_any_line_of_the_write_is_the_interrupt_itself(tmp_path, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    at, finished = 1, False
    while not finished:
        tracer = _Interrupt(at)
        sys.settrace(tracer)
        try:
            write_npz(tmp_path / "x.npz", ARRAYS, 1)
            finished = True  # past the last line: the write ends as usual
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        at += 1
    gc.collect()  # the abandoned archives' __del__ runs: it must not raise either
    assert at > 50  # every line of zipfile's writer and numpy's array format was hit
    assert [(u.exc_value, u.object) for u in unraisable] == []
    with np.load(tmp_path / "x.npz") as data:
        np.testing.assert_array_equal(data["a/x"], ARRAYS["a/x"])
