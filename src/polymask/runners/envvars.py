"""The ``POLYMASK_*`` environment switches, read one way.

A switch is off when its value is ``0``, ``off``, ``false``, ``no``, ``none``
or empty (any case, surrounding spaces ignored); any other value is on.
``POLYMASK_CACHE_DIR`` is a path that these values turn off.
"""

from __future__ import annotations

import os

__all__ = ["OFF_VALUES", "is_off", "env_switch"]

OFF_VALUES = ("", "0", "off", "false", "no", "none")


def is_off(value: str) -> bool:
    """True when an environment value says off (see the module doc)."""
    return value.strip().lower() in OFF_VALUES


def env_switch(name: str, default: bool = True) -> bool:
    """The switch ``name``: ``default`` when unset, else on unless ``is_off``."""
    value = os.environ.get(name)
    return default if value is None else not is_off(value)
