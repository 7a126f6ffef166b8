"""The sentence and table that open a report comparing budget allocations at equal memory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.scenario.load import Experiment, Scenario

RULE_NAMES = {"ada": "AdaKV", "pyramid": "PyramidKV"}


@dataclass(frozen=True)
class Pair:
    """Mean mass of one policy at one budget under uniform and under another allocation."""

    rule: str
    policy: str
    budget: int
    uniform: float
    other: float


def compare(experiments: tuple[Experiment, ...], T: int, rows: list[dict]) -> list[Pair]:
    """Every (allocation, policy, budget) an experiment with decode steps (prompt length
    below ``T``) shares with a ``uniform`` one of the same prompt length; mass = mean of
    ``mass_mean`` over seeds, layers and query heads."""
    def mean_mass(exp_name: str, label: str, budget: int) -> float:
        return float(np.mean([r["mass_mean"] for r in rows if r["experiment"] == exp_name
                              and r["policy"] == label and r["budget"] == budget]))

    pairs = []
    for exp in experiments:
        base = next((e for e in experiments if e.allocation == "uniform"
                     and e.prompt_len == exp.prompt_len), None)
        if exp.allocation == "uniform" or base is None or exp.prompt_len == T:
            continue
        labels = {p.label for p in base.policies}
        for p in exp.policies:
            if p.label in labels and p.kind != "full":
                pairs += [Pair(exp.allocation, p.label, b, mean_mass(base.name, p.label, b),
                               mean_mass(exp.name, p.label, b))
                          for b in exp.budgets if b in base.budgets]
    return pairs


def _where(pairs: list[Pair]) -> str:
    by_policy: dict[str, list[int]] = {}
    for p in pairs:
        by_policy.setdefault(p.policy, []).append(p.budget)
    return "; ".join(f"`{policy}` at B = {', '.join(map(str, budgets))}"
                     for policy, budgets in by_policy.items())


def lines(scenario: Scenario, rows: list[dict]) -> list[str]:
    """The opening sentence (from the numbers) and a table of every pair; none without pairs."""
    pairs = compare(scenario.experiments, scenario.T, rows)
    if not pairs:
        return []
    verdicts, shortfalls = [], []
    for rule in dict.fromkeys(p.rule for p in pairs):
        mine = [p for p in pairs if p.rule == rule]
        more = [p for p in mine if p.other > p.uniform]
        less = [p for p in mine if p.other <= p.uniform]
        change = np.mean([p.other - p.uniform for p in mine])
        verdicts.append(f"{RULE_NAMES[rule]} keeps more than uniform in {len(more)} of "
                        f"{len(mine)} (policy, budget) pairs (mean change {change:+.4f})")
        if less:
            shortfalls.append(f"{RULE_NAMES[rule]} keeps no more than uniform for "
                              f"{_where(less)}")
    sentence = ("At equal memory (the same mean budget B per KV head), measured as the "
                "attention mass kept, averaged over decode steps, layers, query heads and "
                "seeds: " + "; ".join(verdicts) + ".")
    if shortfalls:
        sentence += " Where it does not: " + ". ".join(shortfalls) + "."
    if len(scenario.seeds) == 1:
        widest = max(abs(p.other - p.uniform) for p in pairs)
        sentence += (f" One seed, so no interval: these changes (at most {widest:.4f} in "
                     f"mass) are measured once, not replicated.")
    table = ["| allocation | policy | B | mass uniform | mass allocated | change |",
             "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {RULE_NAMES[p.rule]} | `{p.policy}` | {p.budget} | {p.uniform:.4f} | "
              f"{p.other:.4f} | {p.other - p.uniform:+.4f} |" for p in pairs]
    return [sentence, "", *table, ""]
