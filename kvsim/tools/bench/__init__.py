"""``python -m kvsim bench``: kvsim's speed, measured on this machine, as ratios.

Every figure comes from this run: the machine's own NumPy ``exp`` throughput as the
ceiling of the full pass, the cost of each part of the full pass, kvsim against a
vectorised NumPy implementation of the same simulation, kernel throughputs, end-to-end
wall time and memory, and scaling with T.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np

from kvsim.attention import components
from kvsim.attention.dense import probability_stack
from kvsim.attention.sources import Field
from kvsim.numerics.jit import threads
from kvsim.tools.bench.breakdown import breakdown
from kvsim.tools.bench.numpy_baseline import BASELINES, h2o as numpy_h2o
from kvsim.tools.bench.ratios import pass_floor, qk_versus_numpy
from kvsim.errors import KvsimError
from kvsim.numerics.field import FieldData, dense_field
from kvsim.numerics.fullpass import full_pass
from kvsim.numerics.kernels import row_sums
from kvsim.policies import POLICIES
from kvsim.api import Attention, simulate
from kvsim.protocols.run import field_provides, make_group, resolve_params

SCENARIO = Path(__file__).resolve().parents[3] / "scenarios" / "long_context.toml"


def _timed(fn, repeats: int = 3) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def _best(fn, seconds: float = 0.3, most: int = 25) -> float:
    """The least wall time of ``fn()`` (after one warm-up call) over at least 3 and at most
    ``most`` calls, stopping once ``seconds`` have been spent: load from other processes
    only adds time, so the least is the call it disturbed least (a run of a few
    milliseconds timed once moves by tens of per cent on a shared machine)."""
    fn()
    times: list[float] = []
    while len(times) < 3 or (len(times) < most and sum(times) < seconds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def exp_rate() -> float:
    """NumPy float32 ``exp`` evaluations per second on one core."""
    x = np.random.default_rng(0).random(1 << 22, dtype=np.float32) * -8.0
    out = np.empty_like(x)
    return x.size / _timed(lambda: np.exp(x, out=out), repeats=7)


def bench_field(T: int, noise: bool) -> FieldData:
    """A long-context head: sinks, recency, heavy hitters (and Gaussian noise)."""
    comps = {
        "sinks": {"count": 4, "strength": 6.0},
        "recency": {"kind": "power", "alpha": 0.8, "tau": 64.0},
        "heavy_hitters": {"count": max(T // 128, 1), "fraction": 0.0, "positions": [], "lo": 0,
                          "hi": None, "strength": 7.0, "exponent": 0.6, "important": True},
        "boost": [],
    }
    if noise:
        comps["noise"] = {"kind": "gaussian", "scale": 0.5}
    return components.build([comps], T, 1, seed=0)[0]


def full_pass_rate(T: int, noise: bool, threads: int) -> tuple[float, float]:
    """Logit evaluations per second of the full pass over one head, and the exp ceiling
    (NumPy float32 ``exp`` per second on one core, times ``threads``) timed in turn with it,
    so that load from other processes falls on both alike."""
    field = bench_field(T, noise)
    x = np.random.default_rng(0).random(1 << 22, dtype=np.float32) * -8.0
    out = np.empty_like(x)
    t = _paired({"exp": lambda: np.exp(x, out=out), "pass": lambda: full_pass(field, 0, T - 1024)},
                repeats=1 if T > 16384 else 3)
    return T * (T + 1) / 2 / t["pass"], x.size / t["exp"] * threads


def policy_rates(budgets, prompt_len: int, steps: int) -> dict:
    """Kept-key updates (decode steps x budget) per second of each policy's run (its best
    of several runs, :func:`_best`)."""
    T = prompt_len + steps
    field = bench_field(T, noise=False)
    sequence = Field(field, None)
    group_passes: dict = {}
    out = {}
    for name, policy in POLICIES.items():
        if name == "full":  # its trace is read off the full pass: no kernel of its own
            continue
        if policy.needs - field_provides(field, 0):  # vectors this field does not have
            continue
        params = resolve_params(policy, {})
        for budget in budgets:
            if budget < policy.min_budget(params):
                continue
            group = make_group(field, 0, prompt_len, sequence.mask, group_passes)
            seconds = _best(lambda: policy.run(group, budget, params))
            out[f"{name}@{budget}"] = steps * budget / seconds
    return out


def dense_matrix(T: int) -> np.ndarray:
    """The benchmark field materialised as a dense (T, T) probability matrix."""
    field = bench_field(T, noise=True)
    sequence = Field(field, None)
    group = make_group(field, 0, T, sequence.mask, {})
    return np.stack([row_sums(field, group.row_max, group.row_sum, 0, q, q + 1)
                     for q in range(T)])


def versus_numpy(workloads: dict, repeats: int) -> dict:
    """kvsim.simulate against the NumPy baselines on dense matrices (same results checked)."""
    out = {}
    for name, (T, P, B) in workloads.items():
        A = dense_matrix(T)
        for policy, baseline in BASELINES.items():
            ours = simulate(A, policy, B, P)
            mass, kept = baseline(A, P, B)
            if not (np.allclose(ours.mass, mass, rtol=0, atol=1e-9)
                    and np.array_equal(np.sort(kept), ours.kept)):
                raise AssertionError(f"NumPy baseline and kvsim disagree: {policy} on {name}")
            prepared = dense_field(A[None])  # validated once, like the baseline's input
            spec = POLICIES[policy]
            params = resolve_params(spec, {})
            no_truth = np.zeros((1, T), bool)

            def kvsim_run():  # the simulation proper: full-pass work and the policy kernel
                return spec.run(make_group(prepared, 0, P, no_truth, {}), B, params)

            t_kvsim = _timed(kvsim_run, repeats)
            t_api = _timed(lambda: simulate(A, policy, B, P), repeats)
            t_numpy = _timed(lambda: baseline(A, P, B), repeats)
            out[f"{policy}/{name}"] = {"T": T, "prompt_len": P, "budget": B,
                                       "kvsim_s": t_kvsim, "simulate_s": t_api,
                                       "numpy_s": t_numpy, "speedup": t_numpy / t_kvsim,
                                       "speedup_with_checks": t_numpy / t_api}
    return out


def _paired(functions: dict, repeats: int) -> dict:
    """Median wall time of each function, timed in turn (one warm-up each), so that load
    from other processes falls on all of them alike."""
    for fn in functions.values():
        fn()
    times: dict = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: median(t) for name, t in times.items()}


def api_versus_numpy(T: int, settings: dict, budgets: list[int], repeats: int) -> dict:
    """``kvsim.simulate`` through the public API against the NumPy online H2O peer.

    On one dense float64 (T, T) matrix: the input check a call pays (the matrix is read
    in place, not copied) against a plain ``A.sum()``; per (P, B) setting one call
    ``simulate(A, "h2o", B, P)`` with trusted input (``check=False``; also in the
    ``policies=[...]`` form, whose :class:`Results` add the summary rows), with checks,
    and on an :class:`Attention` built once; and several budgets in one checked call
    against one peer run per budget.
    """
    A = dense_matrix(T)
    out = {"T": T, "check": _paired({"sum": A.sum,
                                     "check": lambda: probability_stack(A, "probs")}, repeats)}
    out["check"]["ratio"] = out["check"]["check"] / out["check"]["sum"]
    att = Attention.from_probs(A)
    for name, (P, B) in settings.items():
        one = simulate(A, "h2o", B, P)
        many = simulate(A, policies=["h2o"], budgets=[B], prompt_len=P, check=False)
        mass, kept = numpy_h2o(A, P, B)
        if not (np.allclose(one.mass, mass, rtol=0, atol=1e-9)
                and np.array_equal(one.kept, np.sort(kept))
                and np.array_equal(many.mass("h2o", B)[0], one.mass)):
            raise AssertionError(f"NumPy h2o and kvsim.simulate disagree on {name}")
        t = _paired({
            "numpy": lambda: numpy_h2o(A, P, B),
            "trusted": lambda: simulate(A, "h2o", B, P, check=False),
            "trusted_results": lambda: simulate(A, policies=["h2o"], budgets=[B],
                                                prompt_len=P, check=False),
            "checked": lambda: simulate(A, "h2o", B, P),
            "reused": lambda: simulate(att, "h2o", B, P)}, repeats)
        out[name] = {"prompt_len": P, "budget": B, **{f"{k}_s": v for k, v in t.items()},
                     **{f"{k}_speedup": t["numpy"] / t[k] for k in t if k != "numpy"}}
    P = settings["prefill_heavy"][0]
    t = _paired({"numpy": lambda: [numpy_h2o(A, P, b) for b in budgets],
                 "one_call": lambda: simulate(A, policies=["h2o"], budgets=budgets,
                                              prompt_len=P)}, max(1, repeats // 2))
    out["budgets"] = {"prompt_len": P, "budgets": budgets, "numpy_s": t["numpy"],
                      "one_call_s": t["one_call"], "speedup": t["numpy"] / t["one_call"]}
    return out


def end_to_end(scenario: Path) -> dict:
    """Wall time and peak memory (:func:`kvsim.tools.bench.memory.peak_of`: the run's
    process's largest resident set) of a scenario run with an empty, then a warm, Numba
    cache; the first run records what it compiles (:mod:`kvsim.tools.bench.compile`:
    ``compile``, the seconds of each kernel)."""
    from kvsim.tools.bench.memory import peak_of  # here: runnable as python -m

    out = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as reports:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        commands = {"cold": ["kvsim.tools.bench.compile", str(scenario), f"{reports}/compile.json"],
                    "warm": ["kvsim", str(scenario), "--out", f"{reports}/warm", "--quiet"]}
        for label, command in commands.items():
            run = peak_of([sys.executable, "-m", *command], env)
            out[label] = {"seconds": run["seconds"], "peak_mb": run["peak_bytes"] / 2**20}
        out["compile"] = json.loads(Path(f"{reports}/compile.json").read_text())
    out["cold_over_warm"] = out["cold"]["seconds"] / out["warm"]["seconds"]
    out["load"] = {"start": load, "end": os.getloadavg()[0]}
    return out


def end_to_end_rows(names: list[str]) -> dict:
    """:func:`end_to_end` of each of the repository's scenario files ``names``, printed
    with the compile table of each first run."""
    from kvsim.tools.bench.compile import lines

    rows = {}
    for name in names:
        scenario = SCENARIO.parent.parent / name
        if not scenario.is_file():
            raise KvsimError(f"bench: expected the repository's {name} (run the benchmark "
                             f"from a checkout of kvsim), got no file at {scenario}")
        r = rows[scenario.stem] = end_to_end(scenario)
        for label in ("cold", "warm"):
            print(f"end to end {scenario.name} ({label} cache): {r[label]['seconds']:.1f} s, "
                  f"peak {r[label]['peak_mb']:.0f} MB")
        print(f"end to end {scenario.name}: cold / warm = {r['cold_over_warm']:.2f} (the "
              f"first run's compilation, in one bench run; load {r['load']['start']:.1f} to "
              f"{r['load']['end']:.1f})")
        print("\n".join(f"  {line}" for line in lines(r["compile"])))
    return rows


def policy_rows(p: dict) -> dict:
    """The policy rows (:func:`policy_rates` on the ``policy`` config), printed."""
    rows = {}
    for key, rate in policy_rates(p["budgets"], p["prompt_len"], p["steps"]).items():
        rows[key] = {"updates_per_s": rate, "per_core": rate}
        print(f"policy {key:<20} {rate / 1e9:7.3f} G kept-key updates/s (one thread)")
    return rows


def scaling(lengths, budget: int, steps: int) -> dict:
    """Full-pass and h2o times against T (one head, fixed decode steps and budget)."""
    out = {}
    policy = POLICIES["h2o"]
    params = resolve_params(policy, {})
    for T in lengths:
        field = bench_field(T, noise=False)
        sequence = Field(field, None)
        start = time.perf_counter()
        passes: dict = {}
        group = make_group(field, 0, T - steps, sequence.mask, passes)
        t_pass = time.perf_counter() - start
        t_policy = _timed(lambda: policy.run(group, budget, params), repeats=1)
        out[T] = {"full_pass_s": t_pass, "h2o_s": t_policy}
    return out


def scaling_figure(result: dict, out: Path) -> Path:
    """Log-log time against T, with the T^2/2 and steps x B reference slopes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = np.array(sorted(result["scaling"]), float)
    rows = [result["scaling"][int(t)] for t in T]
    full = np.array([r["full_pass_s"] for r in rows])
    pol = np.array([r["h2o_s"] for r in rows])
    from kvsim.report.palette import policy_color  # h2o in its colour of every report

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.loglog(T, full, "o-", color=policy_color("full"), label="full-attention pass")
    ax.loglog(T, pol, "s-", color=policy_color("h2o"), label="h2o decode (fixed steps x B)")
    ax.loglog(T, full[0] * (T / T[0]) ** 2, "k--", lw=0.8, label="slope T^2/2")
    ax.loglog(T, np.full_like(T, pol[0]), "k:", lw=0.8, label="slope steps x B (flat in T)")
    s = result["config"]["scaling"]
    ax.set(xlabel="sequence length T", ylabel="seconds (one head)",
           title=f"kvsim scaling on this machine (B = {s['budget']}, {s['steps']} decode steps)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "bench_scaling.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def api_rows(a: dict, quick: bool) -> dict:
    """The Python API rows (:func:`api_versus_numpy` on the ``api`` config), printed."""
    api = api_versus_numpy(a["T"], a["settings"], a["budgets"], repeats=3 if quick else 7)
    c = api["check"]
    print(f"API input check on a {api['T']}^2 float64 matrix: {c['check'] * 1e3:.1f} ms, "
          f"A.sum() {c['sum'] * 1e3:.1f} ms: x{c['ratio']:.2f} the sum")
    for name in a["settings"]:
        r = api[name]
        print(f"API vs NumPy h2o {name} (P = {r['prompt_len']}, B = {r['budget']}): numpy "
              f"{r['numpy_s'] * 1e3:.1f} ms; simulate check=False {r['trusted_s'] * 1e3:.1f} ms "
              f"x{r['trusted_speedup']:.1f} (Results with rows {r['trusted_results_s'] * 1e3:.1f}"
              f" ms x{r['trusted_results_speedup']:.1f}), checked {r['checked_s'] * 1e3:.1f} ms "
              f"x{r['checked_speedup']:.1f}, reused Attention {r['reused_s'] * 1e3:.1f} ms "
              f"x{r['reused_speedup']:.1f}")
    r = api["budgets"]
    print(f"API {len(r['budgets'])} budgets in one checked call (P = {r['prompt_len']}): "
          f"{r['one_call_s'] * 1e3:.1f} ms vs {len(r['budgets'])} NumPy runs "
          f"{r['numpy_s'] * 1e3:.1f} ms: x{r['speedup']:.1f}")
    return api


def bench_config(quick: bool) -> dict:
    """The sizes of every measurement (``quick``: smaller)."""
    return {
        "full_pass_T": [4096, 8192] if quick else [8192, 32768, 131072],
        "policy": {"budgets": [256, 1024] if quick else [256, 1024, 4096],
                   "prompt_len": 8192, "steps": 256 if quick else 1024},
        "numpy": {"prefill_heavy": (4096, 2048, 256), "decode_heavy": (4096, 512, 64)}
        if not quick else {"prefill_heavy": (2048, 1024, 128), "decode_heavy": (2048, 256, 64)},
        "api": {"T": 2048 if quick else 4096,
                "settings": {"prefill_heavy": (1024, 128), "decode_heavy": (256, 64)} if quick
                else {"prefill_heavy": (2048, 256), "decode_heavy": (512, 64)},
                "budgets": [64, 128, 256, 512, 1024]},
        "scaling": {"T": [2048, 4096, 8192] if quick else [4096, 8192, 16384, 32768, 65536, 131072],
                    "budget": 1024, "steps": 1024},
        "end_to_end": ["scenarios/seed_notebook.toml"] if quick
        else ["scenarios/seed_notebook.toml", "scenarios/long_context.toml"],
        "qk": {"T": 4096 if quick else 8192, "d": 64},
    }


def _machine() -> dict:
    import numba

    return {"python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "cores": os.cpu_count(),
            "numba_threads": threads(), "processor": platform.processor()}


def _write(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, out / "bench.json")
    return out / "bench.json"


ONLY = {"api": ("api", lambda config, quick: api_rows(config["api"], quick)),
        "policies": ("policy", lambda config, quick: policy_rows(config["policy"])),
        "end_to_end": ("end_to_end", lambda config, quick: end_to_end_rows(config["end_to_end"]))}
"""The parts ``bench --only`` runs alone: the bench.json key each replaces, the config
key its sizes come from, and how it is measured."""


def run_only(part: str, quick: bool, out: Path) -> dict:
    """Only the rows of ``part`` (:data:`ONLY`): printed, and written into ``out/bench.json``
    in place of its rows of that part (every other row of an existing file kept as it was)."""
    config = json.loads(json.dumps(bench_config(quick)))  # as a written file holds it
    path = out / "bench.json"
    result = json.loads(path.read_text()) if path.is_file() else \
        {"machine": _machine(), "config": config}
    sizes, measure = ONLY[part]
    if result["config"].get(sizes) != config[sizes]:
        raise KvsimError(f"bench --only {part}: expected {path} written with the same sizes "
                         f"({'--quick' if quick else 'no --quick'}), got other {sizes} sizes")
    load = os.getloadavg()
    result[part] = measure(config, quick)
    if part != "end_to_end":  # whose rows carry their own load
        result[part]["load"] = {"start": load[0], "end": os.getloadavg()[0]}
    print(f"wrote the {part} rows into {_write(result, out)}")
    return result


def run_bench(quick: bool, out: Path) -> dict:
    """Run every measurement, print the table, write ``bench.json`` and the figure."""
    config = bench_config(quick)
    result = {"machine": _machine(), "config": config}
    threads = result["machine"]["numba_threads"]
    per_core = exp_rate()
    ceiling = per_core * threads
    result["exp_per_core"] = per_core
    result["exp_ceiling"] = ceiling
    print(f"machine: NumPy float32 exp {per_core / 1e6:,.0f} M/s per core; ceiling x{threads} "
          f"threads = {ceiling / 1e6:,.0f} M/s")
    result["full_pass"] = {}
    for T in config["full_pass_T"]:
        for noise in (False, True):
            rate, paired = full_pass_rate(T, noise, threads)
            key = f"{T}{'+noise' if noise else ''}"
            result["full_pass"][key] = {"logits_per_s": rate, "of_ceiling": rate / ceiling,
                                        "paired_ceiling": paired, "of_paired_ceiling": rate / paired}
            print(f"full pass T={T:>6} {'with noise' if noise else 'no noise  '}: "
                  f"{rate / 1e6:8,.1f} M logits/s = {rate / ceiling:6.1%} of the exp ceiling, "
                  f"{rate / paired:6.1%} of the ceiling timed in turn with it")
    T = config["full_pass_T"][-1]
    noisy = result["full_pass"][f"{T}+noise"]
    print(f"full pass with noise at T={T}: {noisy['of_paired_ceiling']:.1%} of the exp ceiling "
          "timed in turn with it (target 50 %)")
    q = config["qk"]
    qk = result["qk_versus_numpy"] = qk_versus_numpy(q["T"], q["d"], repeats=3)
    print(f"q.k full pass T={qk['T']}, d={qk['d']}: kvsim {qk['kvsim_s']:.3f} s, NumPy Q @ K.T "
          f"+ softmax + column sums {qk['numpy_s']:.3f} s: x{qk['speedup']:.2f} (target >= 1)")
    result["breakdown"] = {"T": T, "ns_per_entry_one_thread": breakdown(
        bench_field(T, noise=True), bench_field(T, noise=False))}
    print(f"full pass parts at T={T}, one thread (NumPy float32 exp: {1e9 / per_core:.2f} ns):")
    for part, ns in result["breakdown"]["ns_per_entry_one_thread"].items():
        print(f"  {part:<40} {ns:5.2f} ns per entry")
    result["policies"] = policy_rows(config["policy"])
    result["numpy"] = versus_numpy(config["numpy"], repeats=1 if quick else 3)
    for key, r in result["numpy"].items():
        print(f"vs NumPy {key:<28} kvsim {r['kvsim_s']:7.4f} s  numpy {r['numpy_s']:7.4f} s  "
              f"speed-up x{r['speedup']:.1f}  (simulate() with input checks "
              f"{r['simulate_s']:.4f} s: x{r['speedup_with_checks']:.1f})")
    result["api"] = api_rows(config["api"], quick)
    result["end_to_end"] = end_to_end_rows(config["end_to_end"])
    if not quick:  # the flagship's warm run against its full passes at the measured rate
        scenario = SCENARIO.parent.parent / "scenarios/long_context.toml"
        floor = pass_floor(scenario, noisy["logits_per_s"])
        floor["share_of_warm"] = floor["seconds"] / result["end_to_end"]["long_context"]["warm"]["seconds"]
        result["pass_share"] = floor
        print(f"{scenario.name}: {floor['passes']} full passes at T={floor['T']} take "
              f"{floor['seconds']:.1f} s at the measured rate: {floor['share_of_warm']:.0%} of "
              "the warm run")
    s = config["scaling"]
    result["scaling"] = scaling(s["T"], s["budget"], s["steps"])
    for T, r in result["scaling"].items():
        print(f"scaling T={T:>6}: full pass {r['full_pass_s']:8.2f} s, h2o {r['h2o_s']:6.3f} s")
    print(f"wrote {_write(result, out)} and {scaling_figure(result, out)}")
    return result
