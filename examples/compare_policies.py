"""Compare six eviction policies at four budgets on attention captured from SmolLM2-135M.

Run from the repository root:

    python examples/compare_policies.py [--out reports/example]

It loads the committed trace (layer 0, 9 query heads sharing 3 KV heads, 2,048 tokens),
simulates every policy at every budget in one call, prints the mean attention mass each
keeps and saves the report's mass-against-budget figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvsim

TRACE = Path(__file__).resolve().parent.parent / "scenarios" / "traces" / "smollm2_gpl3.npz"
POLICIES = ["window", "streaming_llm", "h2o", "snapkv", "tova", "oracle"]
BUDGETS = [64, 128, 256, 512]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports/example"),
                        help="folder for the figure (default reports/example)")
    args = parser.parse_args()

    att = kvsim.Attention.from_trace(TRACE)  # checked once, on load
    res = kvsim.simulate(att, policies=POLICIES, budgets=BUDGETS, prompt_len=1024)

    print(f"{att}\nmean attention mass kept over {att.T - 1024} decode steps, "
          f"averaged over {att.heads} heads:")
    print("policy".ljust(14) + "".join(f"B={b:<6}" for b in BUDGETS))
    for policy in POLICIES:
        means = [res.mass(policy, b).mean() for b in BUDGETS]
        print(policy.ljust(14) + "".join(f"{m:<8.3f}" for m in means))
    for path in res.plot("mass_vs_budget", args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
