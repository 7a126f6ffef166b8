"""Texts shipped with kvsim, so that real-text inputs need no download and no system file.

- ``gpl-3``: the GNU General Public License, version 3, verbatim (``gpl-3.txt``; its own
  terms allow verbatim copies). The text of the committed SmolLM2 trace and closed loop.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = {"gpl-3": "gpl-3.txt"}


def shipped_text(name: str) -> Path | None:
    """The path of the shipped text called ``name``, or None if there is none."""
    return Path(__file__).parent / SHIPPED[name] if name in SHIPPED else None
