"""Policy colours and markers, from the registry (:class:`kvsim.policies.Presentation`).

A policy draws in its declared colour, or in a shade of its family's hue: the hue of the
family's first declared colour (else one set by the family's name), each member without a
colour of its own a further shade. Such a drawn colour is not checked against the other
policies' (the declared ones are, by tests/test_figure_standard.py), so a figure checks it:
where it lies within :data:`APART` of a colour drawn before it, the label takes the
nearest colour that is :data:`APART` from all of them (:func:`spread`). Markers are fixed
per policy in the same way (:func:`markers`).
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Collection

import matplotlib.colors
import numpy as np

from kvsim.policies import POLICIES

APART = 30  # CIELAB distance between two colours of a figure: a different hue, not a shade
MARKERS = "osD^vP*Xh<>p"
SHADES = ((55, 50), (40, 45), (68, 40), (48, 60))  # (lightness, chroma) of members 0, 1, ...
GOLDEN_ANGLE = 137.508  # degrees between the hues of families placed by name


def _lab(rgb: np.ndarray) -> np.ndarray:
    """CIELAB (D65) of sRGB rows ``(..., 3)`` in [0, 1]."""
    linear = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = linear @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                             [0.0193, 0.1192, 0.9505]]).T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]),
                     200 * (f[..., 1] - f[..., 2])], axis=-1)


def cielab(color: str) -> np.ndarray:
    """CIELAB (D65) of an sRGB colour: distances in it follow perceived differences."""
    return _lab(np.array(matplotlib.colors.to_rgb(color)))


@functools.cache
def _candidates() -> tuple[tuple[str, ...], np.ndarray]:
    """The colours a drawn colour may take: a 16-level sRGB cube, lightness in [30, 80]
    (neither near black nor pastel), and their CIELAB."""
    levels = np.arange(0, 256, 17) / 255
    rgb = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), axis=-1).reshape(-1, 3)
    lab = _lab(rgb)
    keep = (lab[:, 0] >= 30) & (lab[:, 0] <= 80)
    return tuple(matplotlib.colors.to_hex(c) for c in rgb[keep]), lab[keep]


def _nearest(target: np.ndarray, allowed: np.ndarray | None = None) -> int:
    """The index of the candidate nearest ``target`` in CIELAB (among ``allowed``)."""
    gaps = np.linalg.norm(_candidates()[1] - target, axis=1)
    return int(np.argmin(gaps if allowed is None else np.where(allowed, gaps, np.inf)))


def policy_color(name: str) -> str | None:
    """The colour of policy ``name`` (None if no policy has that name): its declared one, or
    the shade of its family's hue for the k-th member without one (:data:`SHADES`, the
    hue turning 20 degrees each time they repeat)."""
    if name not in POLICIES:
        return None
    shown = POLICIES[name].presentation
    if shown.color is not None:
        return shown.color
    members = [p for p in POLICIES.values() if p.presentation.family == shown.family]
    declared = [p.presentation.color for p in members if p.presentation.color is not None]
    if declared:
        _, a, b = cielab(declared[0])
        hue = math.degrees(math.atan2(b, a))
    else:
        hue = GOLDEN_ANGLE * zlib.crc32(shown.family.encode())
    k = [p.name for p in members if p.presentation.color is None].index(name)
    lightness, chroma = SHADES[k % len(SHADES)]
    angle = math.radians(hue + 20 * (k // len(SHADES)))
    target = np.array([lightness, chroma * math.cos(angle), chroma * math.sin(angle)])
    return _candidates()[0][_nearest(target)]


def declared_color(name: str) -> bool:
    """Whether policy ``name`` declares its colour (a colour it keeps in every figure)."""
    return POLICIES[name].presentation.color is not None


def spread(colors: dict[str, str], movable: Collection[str]) -> dict[str, str]:
    """``colors`` with each ``movable`` label, in order, moved where its colour lies within
    :data:`APART` of a colour placed before it (every other label's, and the movable ones
    before it): to the candidate nearest its own colour among those :data:`APART` from all
    of them, or, where none is, to the one farthest from them."""
    names, lab = _candidates()
    out = dict(colors)
    placed = np.array([cielab(c) for label, c in colors.items() if label not in movable])
    placed = placed.reshape(-1, 3)
    gaps = np.linalg.norm(lab[:, None] - placed[None], axis=2).min(axis=1, initial=np.inf)
    for label in (label for label in colors if label in movable):
        own = cielab(colors[label])
        if np.linalg.norm(placed - own, axis=1).min(initial=np.inf) < APART:
            pick = _nearest(own, gaps >= APART) if gaps.max() >= APART else int(np.argmax(gaps))
            out[label], own = names[pick], lab[pick]
        placed = np.vstack([placed, own])
        gaps = np.minimum(gaps, np.linalg.norm(lab - own, axis=1))
    return out


def policy_marker(name: str) -> str | None:
    """The marker of policy ``name`` (None if no policy has that name): its declared one, or
    that of its place in the registry."""
    if name not in POLICIES:
        return None
    return POLICIES[name].presentation.marker or MARKERS[list(POLICIES).index(name) % len(MARKERS)]


def markers(labels: list[str], kinds: dict[str, str] | None = None) -> dict[str, str]:
    """``{label: marker}`` for one figure: a label takes its policy's marker (the label's
    own, or that of ``kinds[label]``) unless a label before it has it; the others, in
    order, the markers no label uses yet (all of them in turn, past that)."""
    labels = list(dict.fromkeys(labels))
    kinds = kinds or {}
    out = {}
    for label in labels:
        marker = policy_marker(label) or policy_marker(kinds.get(label, ""))
        if marker is not None and marker not in out.values():
            out[label] = marker
    free = [m for m in MARKERS if m not in out.values()] or list(MARKERS)
    rest = [label for label in labels if label not in out]
    out.update({label: free[i % len(free)] for i, label in enumerate(rest)})
    return {label: out[label] for label in labels}
