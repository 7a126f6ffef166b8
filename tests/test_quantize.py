"""KIVI storage (``[experiment.quantize]``): the kernels against the plain reference (mass
and output error over quantised keys and values, every step), rounding and edge cases,
bytes, and the one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from kvsim.engine.records import bytes_columns
from kvsim.engine.storage import run_quantised
from kvsim.errors import ScenarioError
from kvsim.numerics.field import FieldData, empty_field
from kvsim.numerics.kernels import GQA_MODES
from kvsim.numerics.quantize import Quantize, cache_bytes, quantise_groups
from kvsim.policies import POLICIES
from kvsim.protocols.run import make_group, resolve_params, run_policy
from kvsim.scenario.load import load_scenario


def _field(rng, T: int, G: int, d: int, dv: int, kind: str) -> FieldData:
    f = empty_field(G, T, 1)
    if kind == "ints":  # small integers: constant groups and exact half steps
        q, k = rng.integers(-2, 3, (G, T, d)), rng.integers(-2, 3, (1, d, T))
        v = rng.integers(-2, 3, (1, T, dv))
    else:
        q, k, v = (rng.standard_normal((G, T, d)), rng.standard_normal((1, d, T)),
                   rng.standard_normal((1, T, dv)))
    f["queries"] = np.asarray(q, np.float32)
    f["keys"] = np.ascontiguousarray(k, np.float32)
    f["values"] = np.asarray(v, np.float32)
    f["value_heads"] = np.ones(1, bool)
    f["qk_scale"] = rng.uniform(0.3, 2.0, G)
    return FieldData(**f)


def test_rounding_is_half_even_and_constant_groups_are_exact():
    # lo 0, hi 3, 2 bits: s = 1, so 0.5 -> 0, 1.5 -> 2, 2.5 -> 2 (half to even)
    values = np.array([[0.0, 3.0, 0.5, 1.5, 2.5, 1.0]])
    want = ref.kivi_dequantise_group(list(values[0]), 2)
    assert want == [0.0, 3.0, 0.0, 2.0, 2.0, 1.0]
    out = values.copy()
    quantise_groups(out, 1, 6, 2, 6)  # one token, one group of 6 channels
    assert out[0].tolist() == want
    keys = np.full((2, 4), 0.7)  # every channel constant: read back exactly
    quantise_groups(keys, 2, 4, 2, 4)
    assert (keys == 0.7).all()


@pytest.mark.parametrize("case", range(10))
def test_quantise_matches_the_reference(case):
    rng = np.random.default_rng(case)
    n, d, group = int(rng.integers(1, 40)), 8, (1, 2, 4, 8)[case % 4]
    residual = group * int(rng.integers(1, 4))
    bits = int(rng.integers(1, 5))
    keys = rng.standard_normal((n, d)) if case % 2 else rng.integers(-2, 3, (n, d)) * 1.0
    values = rng.standard_normal((n, d))
    want_k, want_v = ref.kivi_cache(keys, values, bits, group, residual)
    got_k, got_v = keys.T.copy(), values.copy()
    nk = residual * ((n - 1) // residual)
    quantise_groups(got_k, d, nk, bits, group)
    quantise_groups(got_v, max(n - 1 - residual, 0), d, bits, group)
    assert np.array_equal(got_k.T, want_k) and np.array_equal(got_v, want_v)


CASES = [("tova", {}), ("window", {}), ("h2o", {}), ("full", {}), ("snapkv", {"window": 3}),
         ("cake", {"window": 2})]


@pytest.mark.parametrize("name, params", CASES)
@pytest.mark.parametrize("seed", range(4))
def test_mass_and_error_match_the_reference(name, params, seed):
    rng = np.random.default_rng([seed, len(name)])
    G = int(rng.integers(1, 4))
    T = int(rng.integers(6, 40))
    field = _field(rng, T, G, 4, 4, ("gauss", "ints")[seed % 2])
    src = ref.qk_source(field.queries, field.keys[0].T, field.values[0], field.qk_scale)
    gqa = ("mean", "max", "sum")[seed % 3]
    for P in sorted({1, int(rng.integers(1, T)), T - 1}):
        for quant in (Quantize(2, 2, 2), Quantize(4, 4, 4), Quantize(1, 1, 3)):
            budget = max(POLICIES[name].min_budget(resolve_params(POLICIES[name], params)),
                         int(rng.integers(2, T)))
            policy = POLICIES[name]
            group = make_group(field, 0, P, np.zeros((G, T), bool), {}, GQA_MODES[gqa])
            got = run_quantised(policy, group, budget, None, resolve_params(policy, params),
                                False, "a test field", quant)
            width = T if not policy.budgeted else budget
            every = make_group(field, 0, P, np.zeros((G, T), bool), {}, GQA_MODES[gqa],
                               snap_budget=width, snap_steps=np.arange(T - P))
            exact = run_policy(policy, every, budget, resolve_params(policy, params))
            caches = [sorted(int(k) for k in row if k >= 0) for row in exact.snapshots]
            mass, error = ref.kivi_metrics(src, P, caches, quant.bits, quant.group,
                                           quant.residual)
            ctx = f"{name} T={T} P={P} B={budget} {quant}"
            np.testing.assert_allclose(got.mass, mass, rtol=0, atol=1e-9, err_msg=ctx)
            np.testing.assert_allclose(got.error, error, rtol=0, atol=1e-9, err_msg=ctx)
            assert np.array_equal(got.cache_size, exact.cache_size)
            assert ((got.mass >= 0) & (got.mass <= exact.mass + 1e-9)).all(), ctx


def test_nothing_quantised_gives_the_exact_metrics():
    """n <= R (and so n - 1 - R < 0): the kept mass and the exact output error."""
    rng = np.random.default_rng(9)
    field = _field(rng, 30, 2, 4, 4, "gauss")
    policy = POLICIES["tova"]
    for P, budget in ((10, 8), (20, 16), (29, 5)):
        group = make_group(field, 0, P, np.zeros((2, 30), bool), {})
        exact = run_policy(policy, group, budget, {})
        got = run_quantised(policy, group, budget, None, {}, False, "f", Quantize(2, 4, 16))
        np.testing.assert_allclose(got.mass, exact.mass, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got.error, exact.error, rtol=0, atol=1e-12)


def test_bytes_count_codes_groups_and_exact_elements():
    q = Quantize(bits=2, group=32, residual=32)
    # n = 100, d = dv = 64: keys 96 quantised (3 groups of 32 per channel), 4 exact;
    # values 67 quantised (2 groups each), 33 exact.
    keys = 96 * 64 * 2 // 8 + 4 * 3 * 64 + 2 * 4 * 64
    values = 67 * 64 * 2 // 8 + 4 * 67 * 2 + 2 * 33 * 64
    assert cache_bytes(np.array([100]), 64, 64, q).tolist() == [keys + values]
    assert cache_bytes(np.array([10]), 64, 64, q).tolist() == [2 * 10 * 128]  # n <= R
    assert cache_bytes(np.array([10]), 64, 64, None).tolist() == [2 * 10 * 128]
    cols = bytes_columns(np.array([10, 100]), 64, 64, q)
    assert cols == {"kv_bits": 2, "bytes_mean": (2560 + keys + values) / 2,
                    "bytes_peak": float(keys + values)}
    assert np.isnan(bytes_columns(np.array([3]), 0, 0, None)["bytes_mean"])


def _scenario(tmp_path, attention: str, quantize: str):
    (tmp_path / "s.toml").write_text(
        f"{attention}\n[policies.tova]\n[[experiment]]\nprompt_len = 32\nbudgets = [16]\n"
        f"[experiment.quantize]\n{quantize}\n")
    return tmp_path / "s.toml"


QK = '[attention]\nsource = "field"\nT = 48\n[attention.qk]\ndim = {d}\nvalues = true\n'


@pytest.mark.parametrize("attention, quantize, expected", [
    (QK.format(d=64), "group = 32\nresidual = 48", "experiment[0].quantize.residual: expected "
     "a multiple of group (32), got 48"),
    (QK.format(d=48), "group = 32\nresidual = 32", "experiment[0].quantize.group: expected a "
     "divisor of the key dimension 48, got 32"),
    ('[attention]\nsource = "seed_notebook"\nT = 48', "bits = 2", "experiment[0].quantize: "
     "expected a source with key and value vectors"),
    (QK.format(d=64), "bits = 9", "experiment[0].quantize.bits: expected"),
    (QK.format(d=64), "bytes = 2", "experiment[0].quantize.bytes"),
])
def test_bad_settings_are_one_line_errors(tmp_path, attention, quantize, expected):
    with pytest.raises(ScenarioError) as info:
        load_scenario(_scenario(tmp_path, attention, quantize))
    assert expected in str(info.value)


def test_a_quantised_experiment_runs_and_reports_bytes(tmp_path):
    from kvsim.engine.experiments import simulate_scenario
    from kvsim.report import bytes_figure, plotting
    from kvsim.report.figures import Target
    scenario = load_scenario(_scenario(tmp_path, QK.format(d=64), "bits = 4\ngroup = 32"))
    rows = simulate_scenario(scenario, progress=False, workers=1).rows
    assert rows and all(r["kv_bits"] == 4 and 0 < r["mass_mean"] <= 1 for r in rows)
    assert all(r["bytes_peak"] <= 2 * 16 * 128 for r in rows)
    ctx = plotting.figure_context(scenario)
    png, = [p for p in bytes_figure.mass_vs_bytes(ctx, rows, Target(tmp_path, ""))
            if p.suffix == ".png"]
    width = int.from_bytes(png.read_bytes()[16:20], "big")  # the PNG header's width
    assert 0 < width <= plotting.MAX_WIDTH_PX


def test_figures_draw_full_under_kivi(tmp_path):
    """Under KIVI storage `full` loses mass and has a real output error: drawn, not named."""
    from kvsim.report import figures
    scenario = load_scenario(_scenario(tmp_path, QK.format(d=64), "bits = 2"))
    exp = scenario.experiments[0]
    plain = type(exp)(**{**vars(exp), "quantize": None,
                         "policies": exp.policies + (type(exp.policies[0])("full", "full", {}),)})
    assert figures._full_labels(plain) == ["full"]
    assert figures._full_labels(type(exp)(**{**vars(plain), "quantize": exp.quantize})) == []


def test_the_report_defines_the_mass_under_kivi(tmp_path):
    """Under KIVI the mass is exp(-KL), not a share of kept keys: report.md says so."""
    from kvsim.engine.experiments import simulate_scenario
    from kvsim.report import markdown
    scenario = load_scenario(_scenario(tmp_path, QK.format(d=64), "bits = 2"))
    results = [simulate_scenario(scenario, progress=False, workers=1)]
    text = " ".join(markdown._reading([scenario], results))
    name = scenario.experiments[0].name
    assert f"Under KIVI storage (`{name}`) the mass is exp(-KL(p~ || p))" in text
    plain = type(scenario.experiments[0])(**{**vars(scenario.experiments[0]), "quantize": None})
    unquantised = type(scenario)(**{**vars(scenario), "experiments": (plain,)})
    assert "KIVI" not in " ".join(markdown._reading([unquantised], results))
