"""What differs between the supported JAX versions (0.10.2 .. 0.12.1; part of
``_jax_compat``).

When JAX is upgraded, look here first: the jaxpr representation (from 0.11 a
``ClosedJaxpr`` is a ``Jaxpr`` with its constants attached, and an open jaxpr
carries them as leading ``invars``), primitives' params (``scan``'s flat
trees, the call primitive's jaxpr), primitives that exist only on some
versions (a masking rule is registered only where its primitive exists), hijax
primitives, and the wording of JAX errors that polymask translates.
``tests/test_jax_compat.py`` checks each against the installed JAX.
"""

from __future__ import annotations

import warnings

import jax
from jax.extend import core as _xcore

from .core import ClosedJaxpr, Jaxpr

JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__[:3])

# The newest JAX the suite passes on (pyproject.toml installs below the next
# minor release). A newer one can change primitives' params (jax 0.12.1 gave
# random_bits several output streams and gather/scatter an out_sharding), which
# the masking rules then do not know: said at import (docs/versions.md).
NEWEST_SUPPORTED = (0, 12, 1)
if JAX_VERSION > NEWEST_SUPPORTED:
    warnings.warn(
        f"polymask is tested with jax 0.10.2 to 0.12.1; jax {jax.__version__} is newer, and "
        "a masking rule that does not know a primitive's new parameters makes polymask.jit "
        "run that program per exact shape, or a masked call fail: install jax==0.12.1 "
        "jaxlib==0.12.1 where that happens (docs/versions.md)", RuntimeWarning, stacklevel=2)

# True where a ClosedJaxpr is a Jaxpr with attached constants (jax >= 0.11)
JAXPR_CARRIES_CONSTS = ClosedJaxpr is Jaxpr

# Primitives that only some supported JAX versions define: (first version that
# has it, first version that no longer has it), None for open. A masking rule
# is registered only where the installed JAX has its primitive
# (``rules.registry.register``); ``tests/test_jax_compat.py`` checks this table
# against ``all_primitives()``.
VERSIONED_PRIMITIVES: dict[str, tuple[tuple | None, tuple | None]] = {
    "closed_call": (None, (0, 11)),   # one call primitive, eval_jaxpr, from 0.11
    "call": (None, (0, 11)),
    "shard_alike": (None, (0, 11)),   # jax._src.shard_alike removed
    "log2": ((0, 11), None),          # jnp.log2 was log(x) / log(2)
    "one_minus_square": ((0, 11), None),  # tanh's derivative
    "polynomial": ((0, 12), None),    # jnp.polyval's Horner loop
    # jax 0.12.1: the pi-scaled trigonometry (jax.scipy.special/stats, lanczos
    # resize), exp2m1/log2p1, fused multiply-adds, poisson and gamma's gradient
    # as primitives, and raw_bits
    **{name: ((0, 12, 1), None) for name in (
        "sinpi", "cospi", "tanpi", "asinpi", "acospi", "atanpi", "atan2pi", "exp2m1",
        "log2p1", "fma", "fmuladd", "random_poisson", "random_gamma_grad", "raw_bits")},
}

# From jax 0.11 the flattened bwd of a custom_vjp_call returns (cotangents,
# logs) (defvjp_with_logs); before, the cotangents alone.
_BWD_RETURNS_LOGS = JAX_VERSION >= (0, 11)


def custom_vjp_cotangents(bwd, *res_and_cts) -> list:
    """The flat input cotangents of a ``custom_vjp_call``'s ``bwd`` param
    (a ``linear_util.WrappedFun``) called on residuals and output cotangents."""
    out = bwd.call_wrapped(*res_and_cts)
    return list(out[0] if _BWD_RETURNS_LOGS else out)



def has_primitive(name: str) -> bool:
    """Whether the installed JAX defines the primitive ``name`` (see
    ``VERSIONED_PRIMITIVES``; any other name is taken to exist)."""
    since, until = VERSIONED_PRIMITIVES.get(name, (None, None))
    v = JAX_VERSION  # (0, 12, 1) >= (0, 12): a bound of two parts is its minor release
    return (since is None or v >= since) and (until is None or v < until)


def scan_counts(params) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's params: explicit
    params on jax 0.10, the first two parts of the ``ft_in`` flat tree
    (consts, carry, xs) from jax 0.11."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def call_jaxpr_of(params):
    """The jaxpr of a call equation (``closed_call`` / ``eval_jaxpr``): its
    ``call_jaxpr`` param, or ``jaxpr`` where ``eval_jaxpr`` names it so (0.10)."""
    return params["call_jaxpr"] if "call_jaxpr" in params else params["jaxpr"]


def hi_primitive_expansion(params):
    """``fun(*flat operands) -> flat results``: a ``call_hi_primitive``
    equation's hijax primitive (``params["_prim"]``, a ``HiPrim``; jax 0.12
    binds ``jnp.searchsorted`` and ``jnp.nonzero(size=)`` so) written with
    ordinary primitives, as JAX lowers it (``HiPrim.expand``)."""
    import jax

    prim = params["_prim"]

    def expanded(*flat):
        out = prim.expand(*jax.tree_util.tree_unflatten(prim.in_tree, flat))
        return jax.tree_util.tree_leaves(out)

    return expanded


def hi_primitive_jvp(params, float_in):
    """``fun(*flat primals, *flat tangents of the float operands) -> flat
    primal results + flat tangents of the float results``: a
    ``call_hi_primitive`` equation's own JVP rule (``HiPrim.jvp``, for example
    ``lax.custom_root``'s implicit function theorem on jax 0.12), or ``None``
    where the hijax primitive defines none (its expansion is differentiated).
    ``float_in`` marks the operands that have tangents; the others get JAX's
    symbolic zero. A symbolic-zero result tangent is given as zeros. ``None``
    also where the derivative is the expansion's anyway
    (``hi_primitive_keeps_its_linearization``)."""
    from jax._src import ad_util as _ad_util
    from jax._src import hijax as _hijax

    prim = params["_prim"]
    if type(prim).jvp is _hijax.HiPrim.jvp or not hi_primitive_keeps_its_linearization(prim):
        return None
    n = len(float_in)

    def jvp(*flat):
        primals, given = list(flat[:n]), iter(flat[n:])
        tangents = [next(given) if f else _ad_util.Zero(_xcore.get_aval(p).to_tangent_aval())
                    for p, f in zip(primals, float_in)]
        unflat = lambda xs: jax.tree_util.tree_unflatten(prim.in_tree, xs)
        out, out_dot = prim.jvp(unflat(primals), unflat(tangents))
        out = prim.out_tree.flatten_up_to(out)
        out_dot = prim.out_tree.flatten_up_to(out_dot)
        floats = [(p, t) for p, t in zip(out, out_dot)
                  if jax.numpy.issubdtype(p.dtype, jax.numpy.inexact)]
        return [*out, *(jax.numpy.zeros_like(p) if isinstance(t, _ad_util.Zero) else t
                        for p, t in floats)]

    return jvp


# jnp's IndexError for x[a:b] with traced bounds: its wording by JAX version
_TRACED_SLICE_MESSAGES = (
    "Slice entries must be static integers",   # jax 0.10
    "slice indices must have static start/stop/step",  # jax 0.11, 0.12
)


def is_traced_slice_bounds_error(e: BaseException) -> bool:
    """jnp's ``IndexError`` for a slice ``x[a:b]`` whose bounds are traced values."""
    return isinstance(e, IndexError) and is_traced_slice_bounds_message(str(e))


def is_traced_slice_bounds_message(text: str) -> bool:
    """Whether ``text`` holds that ``IndexError``'s message (as JAX words it)."""
    return any(m in text for m in _TRACED_SLICE_MESSAGES)


def is_jaxpr(x) -> bool:
    """A jaxpr, closed or open (one class from jax 0.11)."""
    return isinstance(x, (ClosedJaxpr, Jaxpr))


def closed_jaxpr(jaxpr, consts=()):
    """``jaxpr`` closed over ``consts`` (a ``ClosedJaxpr`` is returned as it is).

    ``consts`` bind the jaxpr's constant inputs: its ``constvars`` on jax 0.10,
    its first ``len(consts)`` inputs from jax 0.11, where a jaxpr traced with
    constants and not closed carries them as leading ``invars``.

    Raises:
      ValueError: a jaxpr already closed over a different number of constants.
    """
    if JAXPR_CARRIES_CONSTS:
        if not consts:
            return jaxpr
        if jaxpr.consts and len(jaxpr.consts) != len(consts):
            raise ValueError(f"a closed jaxpr with {len(jaxpr.consts)} constants "
                             f"given {len(consts)}")
        return jaxpr.with_consts(list(consts))
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    return ClosedJaxpr(jaxpr, list(consts))


def jaxpr_inputs(jaxpr, consts) -> tuple[list, list]:
    """``(constant input vars, argument input vars)`` of ``jaxpr`` given the
    ``consts`` it is evaluated with: ``constvars`` and ``invars`` on jax 0.10;
    from jax 0.11 an open jaxpr carries its constants as leading ``invars``, so
    the first ``len(consts)`` inputs bind them (dropping them would shift every
    argument by one: a silent wrong value)."""
    all_vars = [*jaxpr.constvars, *jaxpr.invars]
    n = len(consts)
    if not JAXPR_CARRIES_CONSTS and n != len(jaxpr.constvars):
        raise ValueError(f"a jaxpr with {len(jaxpr.constvars)} constvars given {n} constants")
    return all_vars[:n], all_vars[n:]


def inner_jaxprs(params):
    """``(jaxpr, consts)`` of every jaxpr in an equation's params (a nested
    ``jit``, ``cond`` branches, a ``scan`` body; an open jaxpr has no consts)."""
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, ClosedJaxpr):
                yield x.jaxpr, list(x.consts)
            elif isinstance(x, Jaxpr):  # an open jaxpr (jax 0.10)
                yield x, []


def open_jaxpr(x):
    """The ``Jaxpr`` of a closed or open jaxpr (on jax >= 0.11 one object)."""
    return x.jaxpr if isinstance(x, ClosedJaxpr) else x


def jaxpr_as_fun(jaxpr, consts=()):
    """A Python callable evaluating ``jaxpr`` (a ``Jaxpr`` with ``consts``, or a
    ``ClosedJaxpr``) unmasked: ``fun(*args) -> list of outputs``."""
    return _xcore.jaxpr_as_fun(closed_jaxpr(jaxpr, consts))


def _hi_primitive_staging_home():
    """``(rule table, call_hi_primitive)``: JAX's staging rules, keyed by primitive."""
    from jax._src import hijax as _hijax
    from jax._src.interpreters import partial_eval as _pe

    return _pe.custom_staging_rules, _hijax.call_hi_primitive_p


def hi_primitive_keeps_its_linearization(prim) -> bool:
    """Whether a hijax primitive's derivative is its own, not its expansion's:
    it has float results and linearizes by a rule of its own (``HiPrim.lin``;
    ``lax.custom_root``'s implicit function theorem, where the expansion is a
    solver loop reverse mode cannot differentiate). Not a rule derived from
    its JVP (``linearize_from_jvp``: ``jnp.searchsorted``, ``jnp.nonzero``)."""
    from jax._src import hijax as _hijax

    lin = type(prim).lin
    derived = (_hijax.HiPrim.lin, getattr(_hijax, "_lin_from_jvp", None))
    return (lin not in derived
            and any(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
                    for a in prim.out_avals_flat))


def inline_hi_primitive_staging(trace, source_info, *args_flat, _prim, orig):
    """A staging rule for ``call_hi_primitive`` that traces the hijax
    primitive's expansion (``HiPrim.expand``) in place, as ordinary
    primitives: inside a masked trace the expansion's size comparisons
    (``jnp.nonzero(size=n * (n + 1) // 2)`` in ``jnp.tril_indices``) then
    split the trace like the user's own, and the masking rules see the
    primitives they know. A primitive that keeps its own linearization is
    staged whole (JAX's rule ``orig``): its masking rule keeps that
    derivative (``rules/control_flow.py``)."""
    from jax._src import core as _core

    if hi_primitive_keeps_its_linearization(_prim):
        return orig(trace, source_info, *args_flat, _prim=_prim)
    with _core.set_current_trace(trace):
        args = jax.tree_util.tree_unflatten(_prim.in_tree, args_flat)
        return jax.tree_util.tree_leaves(_prim.expand(*args))


def fast_compile_xla_flags() -> tuple[str, ...]:
    """``XLA_FLAGS`` that make XLA:CPU compiles cheap (its backend optimizations
    and expensive LLVM passes off), for programs compiled once and run once:
    the test suite (``tests/conftest.py``) and the fuzzers. XLA aborts the
    process on a flag it does not know, so only flags the installed jaxlib
    has: the fusion emitters' switch is gone from jaxlib 0.12 (checked on
    0.10.2 and 0.12.0.1; 0.11 is given the common set). Measured on 2 cores
    (one run each, session 30): a third to a half of the suite's time on both
    ends (compiles dominate)."""
    common = ("--xla_backend_optimization_level=0",
              "--xla_llvm_disable_expensive_passes=true",
              "--xla_cpu_parallel_codegen_split_count=1")
    if JAX_VERSION < (0, 11):
        return common + ("--xla_cpu_use_fusion_emitters=false",)
    return common
