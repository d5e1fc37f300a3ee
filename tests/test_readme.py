"""Runs the README's "With flax / equinox / optax" snippets (between the
``readme-test`` markers) in one namespace, in order."""

import os
import re

import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("optax")

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_ecosystem_snippets():
    text = open(README, encoding="utf-8").read()
    part = text.split("<!-- readme-test: begin -->")[1].split("<!-- readme-test: end -->")[0]
    blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    assert len(blocks) >= 3
    ns: dict = {}
    for block in blocks:
        exec(compile(block, README, "exec"), ns)
