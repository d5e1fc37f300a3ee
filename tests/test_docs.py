"""Runs the code of README.md and of every page under docs/ (the documentation
site, mkdocs.yml) and checks what it prints, with Sybil's Markdown parsers.

In each file, the ```python blocks run in order in one namespace per file:
a block of ``>>>`` lines is a doctest (its printed output is compared exactly,
as ``doctest`` does by default), any other
python block is executed (its ``assert``s are the check). A Markdown comment
``<!-- clear-namespace -->`` before a block starts a fresh namespace, so the
block must run on its own (the flax / equinox / optax pages: each block after
its install line); ``<!-- skip: next -->`` skips one block, for code that
needs what a test cannot have (a second machine, a server). Blocks of other
languages (bash, text) are not run: a ```text block shows output that is not
checked (timings) and says so.

One test per file, so a file's blocks stay in one worker and in order under
``pytest -n``. Run one page: ``python -m pytest -q tests/test_docs.py -k explain``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sybil")

from sybil import Sybil  # noqa: E402
from sybil.parsers.markdown import (  # noqa: E402
    ClearNamespaceParser,
    PythonCodeBlockParser,
    SkipParser,
)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# pages whose blocks import flax / equinox / optax (the `examples` extra)
NEEDS = {"ecosystem.md": ("flax", "equinox", "optax"), "training.md": ("flax", "optax"),
         "serving.md": ("flax",)}

# pages whose blocks take >= 4 s on 2 cores (flax models, a server's handlers): the slow tier
SLOW_PAGES = {"README.md", "serving.md", "ecosystem.md"}

SYBIL = Sybil(parsers=[PythonCodeBlockParser(), ClearNamespaceParser(), SkipParser()])


def test_every_page_is_checked():
    """Every Markdown page of the site is in the list (a new page is checked)."""
    assert {p.name for p in PAGES} >= {"README.md", "index.md", "api.md", "explain.md"}


@pytest.mark.parametrize("page", [
    pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW_PAGES else [])
    for p in PAGES])
def test_page_code_blocks(page, monkeypatch):
    for module in NEEDS.get(page.name, ()):
        pytest.importorskip(module)
    # what a reader gets: the library's defaults, not the test suite's switches
    # (tests/conftest.py turns tiered buckets off for every other test)
    monkeypatch.delenv("POLYMASK_TIERED", raising=False)
    monkeypatch.chdir(ROOT)
    # a relative path: source lines in printed outputs read docs/explain.md:NN in any clone
    document = SYBIL.parse(page.relative_to(ROOT))
    for example in document:
        example.evaluate()
