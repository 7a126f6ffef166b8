"""The Python API on every array-like NumPy can view: kvsim's own error or the result of
the same data as a plain C-contiguous array; an Attention owns its data."""

from __future__ import annotations

import numpy as np
import pytest

import kvsim
from kvsim.errors import KvsimError

torch = pytest.importorskip("torch")

T, P = 24, 12


def probs(seed: int = 0, H: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = np.tril(rng.random((H, T, T)) ** 3 + 1e-3)
    return a / a.sum(axis=2, keepdims=True)


def qk(seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, T, 8)), rng.standard_normal((1, T, 8))


POLICIES = {"h2o": {"kind": "h2o"}, "snapkv": {"kind": "snapkv", "window": 4, "kernel": 3},
            "oracle": {"kind": "oracle"}, "tova": {"kind": "tova"}}


def masses(att) -> list:
    res = kvsim.simulate(att, policies=POLICIES, budgets=[6, 9], prompt_len=P, workers=1)
    return [r["mass_mean"] for r in res.rows]


def test_views_memmaps_matrices_and_masked_arrays_give_the_plain_result(tmp_path):
    A = probs()
    want = masses(kvsim.Attention.from_probs(A))
    flipped = np.ascontiguousarray(A[::-1])[::-1]  # negative strides, same values
    wide = np.zeros((2, T, 2 * T))
    wide[:, :, ::2] = A  # a non-contiguous slice
    mm = np.lib.format.open_memmap(tmp_path / "a.npy", mode="w+", dtype=np.float64, shape=A.shape)
    mm[:] = A
    for same in (flipped, wide[:, :, ::2], mm, np.ma.masked_array(A), A.tolist()):
        assert masses(kvsim.Attention.from_probs(same)) == want
    one = kvsim.Attention.from_probs(np.matrix(A[0]))
    assert masses(one) == masses(kvsim.Attention.from_probs(A[0]))


def test_torch_tensors_of_any_float_dtype(tmp_path):
    A = probs()
    def outcome(data):  # the result, or kvsim's one-line error
        try:
            return masses(kvsim.Attention.from_probs(data))
        except KvsimError as exc:
            return str(exc)

    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        t = torch.tensor(A, dtype=dtype, requires_grad=True)
        same = t.detach().float().numpy() if dtype == torch.bfloat16 else t.detach().numpy()
        assert outcome(t) == outcome(same), dtype
    bf = torch.tensor(A, dtype=torch.bfloat16)
    assert masses(kvsim.Attention.from_probs(bf, check=False)) == masses(
        kvsim.Attention.from_probs(bf.float().numpy(), check=False))
    q, k = qk()
    want = masses(kvsim.Attention.from_qk(q, k))
    assert masses(kvsim.Attention.from_qk(torch.tensor(q), torch.tensor(k))) == want
    bf = kvsim.Attention.from_qk(torch.tensor(q).bfloat16(), torch.tensor(k).bfloat16())
    assert masses(bf) == masses(kvsim.Attention.from_qk(torch.tensor(q).bfloat16().float().numpy(),
                                                         torch.tensor(k).bfloat16().float().numpy()))
    for bad in (torch.ones((T, T), dtype=torch.int64), torch.ones((T, T), dtype=torch.bool)):
        with pytest.raises(KvsimError, match="probs: expected"):
            kvsim.Attention.from_probs(bad.tril())


@pytest.mark.parametrize("value, message", [
    (np.array([[1.0, 0.0], [0.5, 0.5]], dtype=object), "probs: expected float16, float32 or float64"),
    ([[1.0], [0.5, 0.5]], "probs: expected an array NumPy can read, got list"),
    (np.ma.masked_array(np.eye(2), mask=[[False, True], [False, False]]),
     "probs: expected an array without masked entries, got 1 masked"),
    (np.array([[1 + 0j, 0], [0.5, 0.5]]), "probs: expected float16, float32 or float64"),
    ("not an array", "probs: expected"),
])
def test_unusable_array_likes_are_one_line(value, message):
    with pytest.raises(KvsimError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvsim.Attention.from_probs(value)


def test_numpy_integer_budgets_and_refused_booleans():
    A = probs()
    a = kvsim.simulate(A[0], "h2o", np.int32(6), np.int64(P))
    b = kvsim.simulate(A[0], "h2o", 6, P)
    assert np.array_equal(a.mass, b.mass)
    res = kvsim.simulate(A, policies=["h2o"], budgets=np.array([6, 9]), prompt_len=np.uint8(P))
    assert [r["budget"] for r in res.rows][:1] == [6]
    for bad in (np.bool_(True), True):
        with pytest.raises(KvsimError, match="expected an integer"):
            kvsim.simulate(A[0], "h2o", bad, P)


@pytest.mark.parametrize("build", ["probs", "qk"])
def test_an_attention_is_not_fooled_by_its_input_changing(build):
    if build == "probs":
        data = probs()
        att = kvsim.Attention.from_probs(data)
        arrays = [data]
    else:
        q, k = (a.astype(np.float32) for a in qk())
        att = kvsim.Attention.from_qk(q, k)
        arrays = [q, k]
    before = masses(att)
    for a in arrays:
        a[...] = np.nan  # the caller's array, written after the Attention was built
    assert masses(att) == before


def test_simulate_on_a_changed_array_is_checked_again():
    A = probs()
    kvsim.simulate(A, policies=["h2o"], budgets=[6], prompt_len=P)
    A[1, 5, 2] = np.nan
    with pytest.raises(KvsimError, match="head 1"):
        kvsim.simulate(A, policies=["h2o"], budgets=[6], prompt_len=P)


def test_a_0d_array_is_refused_as_a_list_would_be():
    A = probs()
    for name, args in (("budgets", {"budgets": np.array(6)}),
                       ("seeds", {"budgets": [6], "seeds": np.array(3)})):
        with pytest.raises(KvsimError, match=rf"^{name}: expected a non-empty list of .*, "
                                             rf"got array\(\d\)$"):
            kvsim.simulate(A, policies=["h2o"], prompt_len=P, **args)
    res = kvsim.simulate(A, policies=["h2o"], budgets=np.array([6]), seeds=np.array([3]),
                         prompt_len=P)
    assert [(r["budget"], r["seed"]) for r in res.rows] == [(6, 3), (6, 3)]


@pytest.mark.parametrize("T", [2**40, 10**9])
def test_a_field_spec_too_large_is_the_cli_cost_refusal(T):
    with pytest.raises(KvsimError, match=r"^spec\.T: expected the run to fit in memory, got "
                                         r"an estimated peak of .*; 2 units"):
        kvsim.Attention.from_spec({"T": T, "heads": 2})


@pytest.mark.parametrize("arguments, message", [
    ({"dask": 3}, "dask: expected a scheduler address 'tcp://HOST:PORT' or 'local:N', got 3"),
    ({"dask": "local:0"}, "--dask: expected local:N with N >= 1"),
    ({"workers": -1}, "workers: expected an integer in [1, 1024], got -1"),
    ({"workers": 2.0}, "workers: expected an integer in [1, 1024], got 2.0"),
])
def test_run_refuses_bad_workers_and_dask_before_any_work(tmp_path, arguments, message):
    (tmp_path / "s.toml").write_text(
        '[attention]\nsource = "field"\nT = 40\nheads = 1\n[policies.window]\n'
        "[[experiment]]\nprompt_len = 20\nbudgets = [8]\nfigures = []\n")
    with pytest.raises(KvsimError) as info:
        kvsim.run(tmp_path / "s.toml", tmp_path / "out", **arguments)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


def _steps(path, change) -> None:
    """Rewrite ``steps.npz`` with ``change(arrays)`` applied."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    change(arrays)
    np.savez(path, **arrays)


def _flatten_mass(arrays) -> None:
    (name,) = [n for n in arrays if n.endswith("/mass")]
    arrays[name] = arrays[name].ravel()  # one unit: the steps as a 1-D array


def _broken_deflate(path) -> None:
    from broken import broken_deflate
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    (mass,) = [n for n in arrays if n.endswith("/mass")]
    broken_deflate(path, arrays, mass, 0.5)


def _set_unit(path, value: str) -> None:
    import csv
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rows[0]["unit"] = value
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("r")
    (folder / "s.toml").write_text(
        '[attention]\nsource = "field"\nT = 40\nheads = 1\n[policies.window]\n'
        "[[experiment]]\nprompt_len = 20\nbudgets = [8]\nfigures = []\n")
    return kvsim.run(folder / "s.toml", folder / "out", workers=1)


@pytest.mark.parametrize("name, tamper, message", [
    ("results.csv", None, "expected a report file"),
    ("steps.npz", None, "expected a report file"),
    ("results.csv", lambda p: p.write_bytes(b"\xff\xfe" + p.read_bytes()), "expected results.csv"),
    ("results.csv", lambda p: p.write_text(p.read_text().replace(",", ";")), "expected results.csv"),
    ("results.csv", lambda p: p.write_text(p.read_text() + "1,2\n"), "line 3 does not have"),
    ("results.csv", lambda p: _set_unit(p, "-1"), "got unit -1 of experiment"),
    ("results.csv", lambda p: _set_unit(p, "7"), "got unit 7 of experiment"),
    ("results.csv", lambda p: _set_unit(p, "x"), "lacks a variant, experiment or integer unit"),
    ("steps.npz", lambda p: p.write_bytes(p.read_bytes()[:100]), "expected steps.npz"),
    ("steps.npz", lambda p: p.write_bytes(b""), "expected steps.npz"),
    ("steps.npz", lambda p: _steps(p, _flatten_mass), "expected the per-step series mass, "
     "cache_size, recall, error of experiment 'experiment0' as (units, decode steps) arrays"),
    ("steps.npz", lambda p: _steps(p, lambda a: a.pop(next(n for n in a if n.endswith("/error")))),
     "expected the per-step series"),
    ("steps.npz", _broken_deflate, "expected steps.npz as kvsim writes it (Error -3"),
    ("scenario.json", lambda p: p.write_text("{not json"), "expected scenario.json"),
    ("scenario.json", lambda p: p.write_text('{"variants": [1, 2]}'), "expected scenario.json"),
    ("scenario.json", lambda p: p.write_text('[]'), "expected scenario.json"),
])
def test_load_report_on_missing_or_tampered_files_names_the_file(report, tmp_path, name,
                                                                 tamper, message):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(report, folder)
    assert len(kvsim.load_report(folder).rows) == 1
    if tamper is None:
        (folder / name).unlink()
    else:
        tamper(folder / name)
    with pytest.raises(KvsimError) as info:
        kvsim.load_report(folder)
    assert str(info.value).startswith(str(folder / name)) and message in str(info.value)
    assert "\n" not in str(info.value)
