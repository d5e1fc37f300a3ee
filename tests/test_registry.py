"""The masking-rule registry: one rule per primitive, every name a real primitive."""

import contextlib

import pytest

from polymask import _jax_compat as compat
from polymask.rules import data_dependent, families, inlined
from polymask.tracing.registry import get_rule, register, register_rule, registered_primitives


def _polymask_primitives() -> set[str]:
    """The ``polymask_*`` primitives defined in ``rules/data_dependent.py``."""
    return {v.name for v in vars(data_dependent).values() if isinstance(v, compat.Primitive)}


def test_polymask_primitives_are_found():
    assert {"polymask_nonzero", "polymask_boolean_mask", "polymask_dynamic_slice"} <= \
        _polymask_primitives()


def test_every_registered_name_is_a_primitive():
    """A registration under a name JAX never binds is dead code (e.g. ``pjit``
    after the primitive became ``jit``). Rules registered by tests are skipped."""
    known = set(compat.all_primitives()) | _polymask_primitives() | set(
        inlined.LIBRARY_PRIMITIVES)
    ours = [n for n in registered_primitives()
            if get_rule(n).__module__.startswith("polymask.")]
    assert [n for n in ours if n not in known] == []


@pytest.mark.parametrize("name", sorted(inlined.LIBRARY_PRIMITIVES))
def test_every_library_primitive_with_a_rule_is_one(name):
    """A rule for another library's primitive (equinox's ``unvmap_any``) names a
    primitive that library defines."""
    module = pytest.importorskip(inlined.LIBRARY_PRIMITIVES[name])
    names = {v.name for v in vars(module).values()
             if isinstance(v, compat.Primitive)}
    assert name in names


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


def test_a_rule_that_needs_a_size_as_a_constant_raises_unsupported_naming_it():
    # a rule meeting a case it cannot handle (JAX's InconclusiveDimensionOperation
    # for int(size), NotImplementedError) surfaces as UnsupportedError naming the
    # primitive and the user's line, the JAX error chained
    import jax
    import jax.numpy as jnp

    import polymask as pm

    def needs_constant(ctx, x, **params):
        raise compat.InconclusiveDimensionOperation("Symbolic dimension 'n' used in a "
                                                    "context that requires a constant")

    f = pm.mask(lambda x: jax.lax.cumlogsumexp(x), "n")  # the line named below
    with _cumlogsumexp_rule(needs_constant):
        with pytest.raises(pm.UnsupportedError, match=r"'cumlogsumexp'.*test_registry\.py.*"
                           r"InconclusiveDimensionOperation: Symbolic dimension 'n'"):
            f(pm.Masked(jnp.ones(4), (jnp.int32(2),)))
    _check_cumlogsumexp_restored(f)


@contextlib.contextmanager
def _cumlogsumexp_rule(rule):
    """``cumlogsumexp``'s masking rule replaced by ``rule`` inside the block."""
    from polymask.tracing import registry

    old = registry.get_rule("cumlogsumexp")
    register("cumlogsumexp", override=True)(rule)
    try:
        yield
    finally:
        register("cumlogsumexp", override=True)(old)


def _check_cumlogsumexp_restored(f):
    import jax.numpy as jnp
    import numpy as np

    import polymask as pm

    np.testing.assert_allclose(f(pm.Masked(jnp.ones(4), (2,))).unpad(), [1.0, 1.0 + np.log(2.0)],
                               rtol=1e-6)


def test_a_rule_whose_bind_fails_a_shape_check_is_an_internal_error_naming_the_line():
    # JAX's shape rules raise TypeError: a rule binding an op on padded operands
    # that disagree is polymask's defect; it surfaces as an UnsupportedError that
    # says so, names the primitive and the user's line, and quotes JAX's error
    import jax
    import jax.numpy as jnp

    import polymask as pm

    def mismatched(ctx, x, **params):
        return jax.lax.add(x, jnp.zeros(x.shape[0] + 1, x.dtype))

    f = pm.mask(lambda x: jax.lax.cumlogsumexp(x), "n")  # the line named below
    with _cumlogsumexp_rule(mismatched):
        for call in (f, jax.jit(f)):
            with pytest.raises(pm.UnsupportedError, match=r"internal error.*'cumlogsumexp'.*"
                               r"test_registry\.py.*TypeError: add got incompatible shapes"
                               r".*report"):
                call(pm.Masked(jnp.ones(4), (jnp.int32(2),)))
    _check_cumlogsumexp_restored(f)


def test_plain_jax_type_errors_inside_a_rule_keep_their_type():
    # only a shape rule's TypeError is polymask's defect: JAX's own refusals
    # (jvp of a custom_vjp, reduce_window's JVP of an input-dependent init value)
    # stay the TypeErrors plain JAX raises, caught by `except TypeError`
    import jax
    import jax.numpy as jnp

    import polymask as pm

    @jax.custom_vjp
    def c(x):
        return jnp.sin(x)

    c.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))
    f = pm.mask(lambda x: jnp.sum(c(x)), "n")
    with pytest.raises(TypeError, match="forward-mode autodiff") as info:
        jax.jvp(lambda d: f(pm.Masked(d, (2,))).data, (jnp.ones(4),), (jnp.ones(4),))
    assert not isinstance(info.value, pm.UnsupportedError)
    g = pm.mask(lambda x: jax.lax.reduce_window(x, x[0], lambda a, b: a * b, (2,), (1,),
                                                "VALID").sum(), "n")
    with pytest.raises(TypeError, match="init_value_tangent") as info:
        jax.grad(lambda d: g(pm.Masked(d, (3,))).data)(jnp.ones(5))
    assert not isinstance(info.value, pm.UnsupportedError)


def test_one_record_per_primitive_registered_by_its_object():
    """Each primitive has one record (rule, precondition, flags); a primitive
    ``jax.lax`` exposes in every supported JAX version is registered by its
    object, not by a name string."""
    import jax.lax as lax
    from jax.lax import linalg as lax_linalg

    from polymask.tracing import registry

    names = registered_primitives()
    assert len(set(names)) == len(names)
    by_name = [n for n in names
               if registry.rule_record(n).primitive is None
               and n not in compat.VERSIONED_PRIMITIVES
               and any(getattr(getattr(m, n + "_p", None), "name", None) == n
                       for m in (lax, lax_linalg))
               and get_rule(n).__module__.startswith("polymask.")]
    assert by_name == []
    rec = registry.rule_record("cholesky")
    assert rec.rule is not None and rec.precondition is None
    assert registry.rule_record("pure_callback").sees_guard


def test_rule_modules_use_no_frame_inspection():
    import pathlib

    rules_dir = pathlib.Path(families.__file__).parent
    assert [p.name for p in rules_dir.glob("*.py") if "_getframe" in p.read_text()] == []
