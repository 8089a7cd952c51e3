"""The guides are all reachable: every page under docs/ is in the site's navigation and linked from
docs/index.md (a new user once found six guides missing from the index)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _guides() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")


def test_every_guide_is_linked_from_the_index() -> None:
    linked = set(re.findall(r"\]\(([a-z0-9_-]+\.md)", (DOCS / "index.md").read_text()))
    missing = [g for g in _guides() if g not in linked]
    assert not missing, f"docs/index.md does not link {missing}"
    assert len(_guides()) >= 17  # the glob found the pages


def test_every_guide_is_in_the_site_navigation() -> None:
    nav = (DOCS.parent / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    pages = set(re.findall(r":\s*([a-z0-9/_-]+\.md)\s*$", nav, flags=re.MULTILINE))
    missing = [g for g in _guides() if g not in pages]
    assert not missing, f"mkdocs.yml's nav lacks {missing}"
