"""Composable attention fields: logit components summed per head, evaluated on the fly.

Each component is a table in the scenario's ``[attention]`` (shared by every head)
and may be overridden per head in ``[[attention.head]]``. Random choices (heavy-hitter
positions and strengths, query/key vectors) are drawn here in Python from seeds
derived from (scenario seed, head or KV head, component), so a field is a pure
function of its parameters and seed; per-entry noise is a counter hash in the kernels.
"""

from __future__ import annotations

import numpy as np

from kvsim.models.rope import rope_frequencies, rotate
from kvsim.numerics.field import FieldData, empty_field
from kvsim.numerics.noise import NOISE_KINDS
from kvsim.params import Param


def _pair(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v) and v[0] <= v[1]


def _positions(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                       for x in v)


LOGIT = 1e4  # bound on every logit term: a sum of a few stays finite, exp() stays defined


def _number(default, help, low=-LOGIT, high=LOGIT):
    return Param(float, default, help, low=low, high=high)


def _count(default, help, low=0, high=None):
    return Param(int, default, help, low=low, high=high)


COMPONENTS: dict[str, dict[str, Param]] = {
    "sinks": {
        "count": _count(4, "number of first tokens that are sinks"),
        "strength": _number(5.0, "logit added to sink keys"),
    },
    "recency": {
        "kind": Param(str, "power", "decay with distance d = q - k", choices=("power", "exp")),
        "alpha": _number(1.0, "power law: -alpha * log(1 + d)", 0.0),
        "tau": _number(64.0, "exponential: -d / tau", 1e-3, 1e12),
    },
    "heavy_hitters": {
        "count": _count(0, "number of heavy-hitter keys drawn with the seed"),
        "fraction": _number(0.0, "share of the keys in [lo, hi) drawn as heavy hitters", 0.0, 1.0),
        "positions": Param(list, [], "explicit positions (instead of count or fraction)",
                           check=_positions, expect="a list of positions >= 0"),
        "lo": _count(0, "first position a drawn heavy hitter may take"),
        "hi": _count(None, "end of the range (default T)"),
        "strength": _number(4.0, "logit of the strongest heavy hitter"),
        "exponent": _number(1.0, "the i-th strongest gets strength * i ** -exponent", 0.0, 1e3),
        "important": Param(bool, True, "count the heavy hitters as ground truth"),
    },
    "noise": {
        "kind": Param(str, "gaussian", "per-entry noise", choices=tuple(NOISE_KINDS)),
        "scale": _number(1.0, "noise scale (standard deviation for gaussian)", 0.0),
    },
    "qk": {
        "dim": _count(64, "vector dimension d", 1, 65536),
        "clusters": _count(8, "number of key clusters", 1, 65536),
        "spread": _number(0.5, "within-cluster spread of keys and queries", 0.0, 1e3),
        "focus": _count(1, "clusters each query mixes", 1, 1024),
        "strength": _number(1.0, "multiplies q . k / sqrt(d)"),
        "values": Param(bool, True, "draw value vectors (enables the output-error metric)"),
        "rope_theta": _number(0.0, "RoPE base: rotate the drawn queries and keys by their "
                                   "positions (rotate-half layout; 0: no RoPE)", 0.0, 1e12),
    },
}

BOOST: dict[str, Param] = {
    "keys": Param(list, [], "key range [lo, hi)", check=lambda v: v == [] or _pair(v),
                  expect="[lo, hi] with 0 <= lo <= hi"),
    "key_positions": Param(list, [], "explicit key positions (instead of keys)",
                           check=_positions, expect="a list of positions >= 0"),
    "queries": Param(list, [], "query range [lo, hi) that attends to the keys", check=_pair,
                     expect="[lo, hi] with 0 <= lo <= hi"),
    "strength": _number(6.0, "logit added to the boosted entries"),
    "important": Param(bool, True, "count the boosted keys as ground truth"),
}


def _layer_key(layer: int) -> list[int]:
    """The layer's part of a draw's key: none for layer 0, so that a one-layer field draws
    exactly what it drew before fields had layers."""
    return [layer] if layer else []


def _seed(seed: int, index: int, tag: str, layer: int = 0) -> np.random.Generator:
    """Generator for (scenario seed, head or KV head, component, layer): independent streams."""
    return np.random.default_rng([seed, index, int.from_bytes(tag.encode(), "little"),
                                  *_layer_key(layer)])


def _heavy_hitters(p: dict, T: int, seed: int, kv: int,
                   layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(positions, strengths); drawn per KV head, so heads of a group share their keys."""
    if p["positions"]:
        positions = np.array(sorted(set(p["positions"])), np.int64)
    else:
        hi = T if p["hi"] is None else min(p["hi"], T)
        lo = min(p["lo"], hi)
        n = p["count"] or int(round(p["fraction"] * (hi - lo)))
        rng = _seed(seed, kv, "heavy_hitters", layer)
        positions = np.sort(rng.choice(np.arange(lo, hi), size=min(n, hi - lo), replace=False))
    rank = _seed(seed, kv, "heavy_rank", layer).permutation(positions.size) + 1
    return positions, p["strength"] * rank.astype(np.float64) ** -p["exponent"]


def _qk(p: dict, T: int, seed: int, h: int, kv: int, layer: int = 0):
    """(queries, keys, values) float32: clustered keys, queries mixing cluster directions."""
    d = p["dim"]
    rng = _seed(seed, kv, "qk_keys", layer)
    centres = rng.standard_normal((p["clusters"], d))
    labels = rng.integers(0, p["clusters"], size=T)
    keys = centres[labels] + p["spread"] * rng.standard_normal((T, d))
    values = rng.standard_normal((T, d)) if p["values"] else np.zeros((T, 0))
    rng = _seed(seed, h, "qk_queries", layer)
    picks = rng.integers(0, p["clusters"], size=(T, p["focus"]))
    queries = centres[picks].mean(axis=1) + p["spread"] * rng.standard_normal((T, d))
    return queries.astype(np.float32), keys.astype(np.float32), values.astype(np.float32)


def build(heads: list[dict], T: int, kv_heads: int, seed: int,
          layer: int = 0) -> tuple[FieldData, np.ndarray | None]:
    """The field of one sequence and its (H, T) ground-truth mask (None if nothing is planted).

    ``heads[h]`` maps component names to their checked parameters (``boost``: a list);
    ``layer`` enters every random draw (layer 0 draws what a field without layers draws).
    """
    H = len(heads)
    group = H // kv_heads
    f = empty_field(H, T, kv_heads)
    truth = np.zeros((H, T), bool)
    planted = False
    boosts = []
    qk_dims = {c["qk"]["dim"] for c in heads if "qk" in c}
    d = qk_dims.pop() if qk_dims else 0
    dv = d if any(c.get("qk", {}).get("values") for c in heads) else 0
    if d:
        f["queries"] = np.zeros((H, T, d), np.float32)
        f["keys"] = np.zeros((kv_heads, d, T), np.float32)  # by dimension: see FieldData
        f["values"] = np.zeros((kv_heads, T, dv), np.float32)
    distance = np.arange(T, dtype=np.float64)
    for h, comp in enumerate(heads):
        kv = h // group
        if "sinks" in comp:
            f["key_bias"][h, :comp["sinks"]["count"]] += comp["sinks"]["strength"]
        if "recency" in comp:
            r = comp["recency"]
            f["distance"][h] = -r["alpha"] * np.log1p(distance) if r["kind"] == "power" \
                else -distance / r["tau"]
        if "heavy_hitters" in comp:
            positions, strengths = _heavy_hitters(comp["heavy_hitters"], T, seed, kv, layer)
            f["key_bias"][h, positions] += strengths
            if comp["heavy_hitters"]["important"] and positions.size:
                truth[h, positions] = planted = True
        for b in comp.get("boost", []):
            keys = np.zeros(T, bool)
            if b["keys"]:
                keys[b["keys"][0]:b["keys"][1]] = True
            else:
                keys[b["key_positions"]] = True
            boosts.append((h, min(b["queries"][0], T), min(b["queries"][1], T), keys,
                           b["strength"]))
            if b["important"] and keys.any():
                truth[h, keys] = planted = True
        if "noise" in comp:
            f["noise_kind"][h] = NOISE_KINDS[comp["noise"]["kind"]]
            f["noise_scale"][h] = comp["noise"]["scale"]
            f["noise_key"][h] = np.random.SeedSequence(
                [seed, h, *_layer_key(layer)]).generate_state(1, np.uint64)[0]
        if "qk" in comp:
            q, k, v = _qk(comp["qk"], T, seed, h, kv, layer)
            theta = comp["qk"].get("rope_theta", 0.0)
            if theta:  # the drawn vectors are the pre-RoPE ones
                freq = rope_frequencies(theta, d)
                if f["pre_rope_queries"].shape[2] == 0:
                    f["pre_rope_queries"] = np.zeros((H, T, d), np.float32)
                    f["rope_freq"] = freq
                f["pre_rope_queries"][h] = q
                q, k = rotate(q, freq).astype(np.float32), rotate(k, freq).astype(np.float32)
            f["queries"][h] = q
            f["keys"][kv] = k.T
            if dv and v.shape[1]:
                f["values"][kv] = v
                f["value_heads"][kv] = True
            f["qk_scale"][h] = comp["qk"]["strength"] / np.sqrt(d)
    if boosts:
        f["boost_head"] = np.array([b[0] for b in boosts], np.int64)
        f["boost_rows"] = np.array([[b[1], b[2]] for b in boosts], np.int64)
        f["boost_keys"] = np.stack([b[3] for b in boosts])
        f["boost_strength"] = np.array([b[4] for b in boosts])
    return FieldData(**f), (truth if planted else None)
