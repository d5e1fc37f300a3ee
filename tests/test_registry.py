"""The masking-rule registry: one rule per primitive, every name a real primitive."""

import pytest

from polymask import _jax_compat as compat
from polymask.rules import data_dependent, families
from polymask.rules.registry import get_rule, register, register_rule, registered_primitives


def _polymask_primitives() -> set[str]:
    """The ``polymask_*`` primitives defined in ``rules/data_dependent.py``."""
    return {v.name for v in vars(data_dependent).values() if isinstance(v, compat.Primitive)}


def test_polymask_primitives_are_found():
    assert {"polymask_nonzero", "polymask_boolean_mask", "polymask_dynamic_slice"} <= \
        _polymask_primitives()


def test_every_registered_name_is_a_primitive():
    """A registration under a name JAX never binds is dead code (e.g. ``pjit``
    after the primitive became ``jit``). Rules registered by tests are skipped."""
    known = set(compat.all_primitives()) | _polymask_primitives()
    ours = [n for n in registered_primitives()
            if get_rule(n).__module__.startswith("polymask.")]
    assert [n for n in ours if n not in known] == []


def test_duplicate_registration_raises_and_names_both_rules():
    def first(ctx, x):
        return x

    def second(ctx, x):
        return x

    name = "polymask_test_duplicate"
    register_rule(name, first)
    with pytest.raises(ValueError, match=r"polymask_test_duplicate.*first.*second"):
        register(name)(second)
    assert get_rule(name) is first
    register(name, override=True)(second)
    assert get_rule(name) is second


def test_existing_rule_cannot_be_replaced_silently():
    with pytest.raises(ValueError, match="'add'"):
        families.defelementwise("add")
