"""Every relative link of the repository's Markdown pages names a file that exists."""

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

SKIPPED = {".venv", ".git", ".models", "node_modules"}
PAGES = sorted(p for p in REPO.rglob("*.md") if not SKIPPED & set(p.parts))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    targets = [t for t in LINK.findall(page.read_text()) if not re.match(r"^[a-z]+:", t)]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, missing
