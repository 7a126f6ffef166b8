"""What a protocol declares (:class:`Protocol`): its settings, when it is asked, its label,
its check, the peak it allows and how it runs. The registry (:mod:`kvsim.protocols.settings`)
reads only these declarations; docs/adding-a-protocol.md adds one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvsim.params import Param
from kvsim.policies.base import Policy


@dataclass(frozen=True)
class Protocol:
    """One protocol. ``proto`` below is the dict of every registered setting, defaults filled
    in (:func:`kvsim.protocols.settings.split`); ``own`` the policy's own parameters.

    - ``name``: its main setting, which names it in the docs;
    - ``params``: its settings, each at its neutral default (the per-step rule);
    - ``asked(proto)``: the setting that names it when asked (in errors and
      :func:`~kvsim.protocols.settings.asked`), or None when its settings are neutral;
    - ``label(proto)``: its part of the results' ``protocol`` column (when asked);
    - ``check(policy, proto, params, budget, prompt_len, T)``: why ``policy`` cannot take
      it at ``budget`` (``params``: the configuration's parameters, settings included), or
      None (the registry checks first that the policy has step code, a
      state layout and no ``refresh``);
    - ``extra(proto)``: the keys it may hold above the budget at once, or None when the
      cache size is an outcome (the peak is then ``T``);
    - ``combines``: the settings (``asked`` names) of other protocols it combines with;
    - one way to run: ``run(policy, group, budget, cap, own, proto) -> Trace``, the whole
      run (a layer-wide protocol); or ``drive(run, group, out, budget, proto, own)``, the
      decode after the policy's own start (:class:`kvsim.protocols.cache.Run`; ``budget``
      the decode budget, the question's keys included), with ``capacity(first, kept,
      free, prompt_len, T, budget, proto)``: the cache slots the run needs (``first``: the
      budget the policy starts at, ``kept`` the keys its start kept, ``free`` the question's
      keys that join freely; by default the decode budget, :func:`every_key` for an
      append-only protocol); ``start_whole``: start the policy with every prompt key, so
      that each has its prefill score (the protocol then makes the prefill selection);
      a protocol with neither changes only the prompt the policy compresses (the question);
    - ``steps_in_model``: a model's layer stepper runs it
      (:class:`kvsim.protocols.stepping.UniformLayer`);
    - ``layer_wide(proto)``: whether it decides for every KV head of a layer at once (a
      budget allocation must then give them one cap).
    """

    name: str
    params: dict[str, Param]
    asked: Callable[[dict], str | None]
    label: Callable[[dict], str]
    check: Callable[..., str | None] | None = None
    extra: Callable[[dict], int | None] = lambda proto: 0
    combines: tuple[str, ...] = ()
    run: Callable | None = None
    drive: Callable | None = None
    capacity: Callable[..., int] = lambda first, kept, free, prompt_len, T, budget, proto: budget
    start_whole: bool = False
    steps_in_model: bool = False
    layer_wide: Callable[[dict], bool] = lambda proto: False


def every_key(first: int, kept: int, free: int, prompt_len: int, T: int, budget: int,
              proto: dict) -> int:
    """The ``capacity`` of an append-only protocol: the ``first`` keys the policy starts
    with and every decode key."""
    return first + T - prompt_len


def judges_scores(policy: Policy, setting: str) -> str | None:
    """Why ``policy`` cannot take ``setting``, a protocol that keeps a key for its current
    score (``Steps.rank``), or None."""
    position_rule = policy.layout.position_rule
    if policy.steps.rank is None or position_rule:
        return (f"{policy.name} takes no {setting}: "
                + ("a position rule keeps no key for its score" if position_rule
                   else "it gives no per-key scores to judge (Steps.rank)"))
    return None
