"""mkdocs hook: the committed report figures a page embeds reach the site.

A page embeds a figure by its path in the repository, relative to ``docs/``:
``![what it shows](../reports/long_context/decode_mass_vs_budget.png)``, a link that also
works on GitHub. The site takes that file from ``reports/`` (outside ``docs_dir``) and
serves it at ``reports/...``; a figure that is not committed fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent
FIGURE = re.compile(r"\]\(\.\./(reports/[\w./-]+\.png)\)")


def on_files(files: Files, config) -> Files:
    """Add every report figure a page embeds to the site's files."""
    docs = Path(config["docs_dir"])
    wanted = {m for page in sorted(docs.glob("*.md")) for m in FIGURE.findall(page.read_text())}
    for path in sorted(wanted):
        if not (ROOT / path).is_file():
            raise PluginError(f"docs embed {path}, which is not a committed report figure")
        files.append(File.generated(config, path, abs_src_path=str(ROOT / path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Point ``../reports/...`` figures at the copies the site serves."""
    return FIGURE.sub(lambda m: f"]({m.group(1)})", markdown)
