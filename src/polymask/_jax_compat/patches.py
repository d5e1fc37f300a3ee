"""Every replacement of JAX behaviour while a masked trace runs, in one table.

When JAX is upgraded, look here first: each row names what is replaced, why,
for which JAX versions, and where the replacement's code lives. The switching
on and off is ``during_masked_trace`` (entered by ``tracing/symbolic.py``
around ``jax.make_jaxpr``): the rows of ``splits.py`` are installed by its
``trace_hooks``, every other row by ``patched_attr`` with the replacement a
rule module gave with ``replace_during_trace``. A replacement must fall back
to JAX's own behaviour outside a masked trace: other threads see it too.
``tests/test_jax_compat.py`` checks that whatever a trace changes in JAX's
modules, classes and rule tables is a row here.

Replacing a JAX function means a size JAX needs as a Python int (a length,
an index dtype, a loop count) or a shape comparison JAX answers
structurally would otherwise fail or be wrong for symbolic sizes; the
replacement computes the same values with symbolic sizes, or turns the
comparison into a case split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.export import shape_poly as _shape_poly
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import convolution as _lax_convolution

from . import core as _core_compat
from . import linalg as _linalg
from . import numeric as _numeric
from . import random as _random
from .core import DimExpr
from .hooks import patched_attr
from .indexing import INDEXING, NDINDEXER, SCATTER
from .splits import _DIVISIONS as DIVISION_METHODS
from .splits import TRACE_REPLACEMENT_CODES, trace_hooks
from .versions import _hi_primitive_staging_home

__all__ = ["TracePatch", "TRACE_PATCHES", "trace_patch", "replace_during_trace",
           "during_masked_trace", "replacement_of"]

ALL_VERSIONS = "all supported (0.10.2 .. 0.12)"


@dataclasses.dataclass(frozen=True)
class TracePatch:
    """One replacement of JAX behaviour during a masked trace.

    ``name``: the replaced function as users know it; ``home()``: ``(module,
    class or rule table, attribute or key)`` replaced; ``replacement``: where
    the replacement's code lives; ``why``: what JAX does there that symbolic
    sizes break; ``jax``: the JAX versions it is needed for.
    """

    name: str
    home: Callable[[], tuple[Any, Any]]
    replacement: str
    why: str
    jax: str = ALL_VERSIONS

    def current(self):
        """What ``home()`` holds now."""
        container, attr = self.home()
        if isinstance(container, dict):
            return container.get(attr)
        return getattr(container, attr, None)  # None: an attribute JAX does not define


_SPLITS = "_jax_compat/splits.py (trace_hooks)"


def _splits_rows() -> tuple[TracePatch, ...]:
    rows = [
        TracePatch("DimExpr.__eq__", lambda: (DimExpr, "__eq__"), _SPLITS,
                   "JAX answers an undecidable == structurally (False for two dim vars "
                   "that may be equal): decided with the trace's bounds, or a case split"),
        TracePatch("DimExpr.__ne__", lambda: (DimExpr, "__ne__"), _SPLITS,
                   "the negation of the split __eq__"),
        TracePatch("DimExpr.__bool__", lambda: (DimExpr, "__bool__"), _SPLITS,
                   "JAX's class has no __bool__, so `if x.shape[0]:` is always true: "
                   "truth is the split `!= 0` (added during the trace, removed after)"),
        TracePatch("DimExpr.__hash__", lambda: (DimExpr, "__hash__"), _SPLITS,
                   "a size looked up by its hash in user code (dict.get(n), n in {4, 8}) "
                   "hashes as itself and silently misses the int key plain JAX finds: "
                   "raised as needing a concrete value, the case is traced size by size"),
        TracePatch("DimExpr.__float__", lambda: (DimExpr, "__float__"), _SPLITS,
                   "JAX's class has none, so float(n) and math.sqrt(n) are a bare "
                   "TypeError: its value as __int__ gives it (needing a concrete value: "
                   "the case is traced size by size; added during the trace, removed after)"),
        TracePatch("DimExpr.sqrt (and NumPy's other math ufuncs)", lambda: (DimExpr, "sqrt"),
                   _SPLITS,
                   "np.sqrt(n) of a size calls n.sqrt(), which JAX's class lacks (a bare "
                   "TypeError): the ufunc of float(n), needing a concrete value (added "
                   "during the trace, removed after)"),
        TracePatch("DimExpr.__pow__", lambda: (DimExpr, "__pow__"), _SPLITS,
                   "JAX raises a bare ValueError for a negative or fractional power of a "
                   "size (d ** -0.5, a Python float of its value on the exact arrays): "
                   "raised as needing a concrete value, the case is traced size by size"),
        TracePatch("DimExpr.max", lambda: (DimExpr, "max"), _SPLITS,
                   "JAX simplifies a slice's size max(0, _u1 - 1) to _u1 - 1 on its "
                   "assumption that a data-dependent size is >= 1; kept as max where "
                   "that size may be 0, so jnp.zeros(sel.shape[0] - 1) (negative at a "
                   "count of 0: plain JAX raises) is told from sel[1:] (empty)"),
        TracePatch("DimExpr.rmax", lambda: (DimExpr, "rmax"), _SPLITS,
                   "the reflected max(0, e) of jax.core.max_dim, as DimExpr.max"),
        TracePatch("DimExpr.min", lambda: (DimExpr, "min"), _SPLITS,
                   "JAX simplifies sel[:1]'s stop min(_u1, 1) to 1 on its assumption that "
                   "a data-dependent size is >= 1; kept as min where that size may be 0"),
        TracePatch("DimExpr.rmin", lambda: (DimExpr, "rmin"), _SPLITS,
                   "the reflected min(c, e) of jax.core.min_dim, as DimExpr.min"),
        TracePatch("shape_poly._geq_decision", lambda: (_shape_poly, "_geq_decision"),
                   _SPLITS, "JAX raises InconclusiveDimensionOperation for an undecidable "
                   ">= / > / <= / <: a case split instead (SplitNeeded)"),
        TracePatch("jnp indexing's rewriting_take", lambda: (INDEXING, "rewriting_take"),
                   _SPLITS + ", _jax_compat/indexing.py",
                   "JAX rejects a size as an integer index (s[s.shape[0] - 1]), where plain "
                   "JAX has an int: checked against its axis as a static index is (an "
                   "IndexError out of bounds, a size comparison), then a traced int"),
        TracePatch("jnp indexing's to_static_slice", lambda: (NDINDEXER, "to_static_slice"),
                   _SPLITS + ", _jax_compat/indexing.py",
                   "JAX gathers for static indexing of any array with a symbolic shape; "
                   "static indices on static axes become a slice"),
        TracePatch("x.at[...] updates (scatter._scatter_update)",
                   lambda: (SCATTER, "_scatter_update"), _SPLITS + ", _jax_compat/indexing.py",
                   "JAX rejects a size as an integer index of an update (x.at[n - 1].set(v)), "
                   "where plain JAX has an int: a traced int (dropped out of bounds, as "
                   "plain JAX drops a static one)"),
        TracePatch("jnp indexing's to_dynamic_slice", lambda: (NDINDEXER, "to_dynamic_slice"),
                   _SPLITS + ", _jax_compat/indexing.py",
                   "JAX gathers for a scalar integer index of an array with a symbolic "
                   "axis taken whole (y[i] of (n, m)), where concrete shapes give a "
                   "dynamic_slice: the two differ in the gradient of an index out of "
                   "bounds (clamped by dynamic_slice, dropped by a gather's transpose)"),
        TracePatch("call_hi_primitive's staging rule", _hi_primitive_staging_home,
                   _SPLITS + ", _jax_compat/versions.py (inline_hi_primitive_staging)",
                   "a hijax primitive's expansion is traced in place, so its size "
                   "comparisons split like the user's and the rules see known primitives"),
        TracePatch("DynamicJaxprTrace.process_primitive",
                   lambda: (_pe.DynamicJaxprTrace, "process_primitive"),
                   _SPLITS + " (_stage_symbolic_constants)",
                   "jax.ensure_compile_time_eval evaluates x.shape[0] as a value and "
                   "arrays of a symbolic shape eagerly, which cannot be evaluated: staged; "
                   "and a size used as a number (dim_as_value) past JAX's int dtype raises "
                   "OverflowError as plain JAX's Python int does, instead of wrapping"),
    ]
    for method in DIVISION_METHODS:
        rows.append(TracePatch(f"DimExpr.{method}", functools.partial(lambda m: (DimExpr, m),
                                                                      method),
                               _SPLITS + " (_python_division)",
                               "Python arithmetic on a size that may be 0 raises "
                               "ZeroDivisionError on exact arrays: the divisor splits the "
                               "trace and the size-0 case is an error case"))
    return tuple(rows)


def _rule_rows() -> tuple[TracePatch, ...]:
    lax_numpy = _numeric.lax_numpy_module
    return (
        TracePatch("jnp.trim_zeros", lambda: (jnp, "trim_zeros"), "ops/trimming.py",
                   "JAX reads the operand's values on the host to slice: boolean_mask "
                   "along each trimmed axis instead"),
        TracePatch("jax._src.numpy trim_zeros", lambda: (lax_numpy(), "trim_zeros"),
                   "ops/trimming.py", "the same, for JAX's internal calls"),
        TracePatch("jnp.linalg.pinv (_pinv)", _linalg.pinv_home, "rules/linalg_lstsq.py",
                   "a rectangular SVD with singular vectors has no exact mask: a thin SVD "
                   "from QR and a square SVD"),
        TracePatch("jnp.linalg.lstsq (_jit_lstsq)", _linalg.lstsq_home,
                   "rules/linalg_lstsq.py", "the same as pinv"),
        TracePatch("jnp.searchsorted", lambda: (jax.numpy, "searchsorted"), "rules/numeric.py",
                   "JAX picks the index dtype from the length as a Python int"),
        TracePatch("jax._src.numpy searchsorted (digitize)",
                   lambda: (lax_numpy(), "searchsorted"), "rules/numeric.py",
                   "the same, for jnp.digitize and histogram"),
        TracePatch("jnp.interp (_interp)", _numeric.interp_home, "rules/numeric.py",
                   "JAX calls len(xp)"),
        TracePatch("jnp.convolve / correlate (_conv)", _numeric.conv_home, "rules/numeric.py",
                   "JAX calls len(x) for the output size and mode"),
        TracePatch("iter(tracer) (Tracer.__iter__)", _core_compat.tracer_iteration_home,
                   "rules/slicing.py",
                   "JAX unstacks an iterated axis into that many values, and at a symbolic "
                   "size fails inside its own code (an AttributeError): said as a size "
                   "needed as a constant"),
        TracePatch("jnp.fft's n= / s= (_fft_core)", _numeric.fft_core_home, "rules/numeric.py",
                   "JAX takes the lengths as ints (operator.index): a length computed "
                   "from a size (hyena's rfft(u, n=2 * T)) is a dimension expression"),
        TracePatch("jnp.pad(mode='wrap') (_pad_wrap)", lambda: (lax_numpy(), "_pad_wrap"),
                   "rules/numeric.py",
                   "JAX divides the pad width by the size in Python (divmod) and repeats "
                   "the array that many times: a gather of (i - before) mod n instead"),
        TracePatch("jnp.pad(mode='reflect' / 'symmetric') (_pad_symmetric_or_reflect)",
                   lambda: (lax_numpy(), "_pad_symmetric_or_reflect"), "rules/numeric.py",
                   "JAX reflects in a Python loop as often as the width needs and refuses "
                   "widths it cannot prove at most the size: a gather of the periodic "
                   "reflection instead"),
        TracePatch("jax.random shuffle (_shuffle)", _random.shuffle_home,
                   "rules/random_samplers.py",
                   "JAX computes the number of sort rounds from the size in Python"),
        TracePatch("JAX's internal jnp.searchsorted (choice(p=...))", _random.searchsorted_home,
                   "rules/random_samplers.py", "a binary search with the logical length"),
        TracePatch("jax.random.permutation", lambda: (jax.random, "permutation"),
                   "rules/random_samplers.py",
                   "permutation(key, n) needs n as a Python int: permutation of arange(n)"),
        TracePatch("x.reshape(-1, ...) (_compute_newshape)", _numeric.newshape_home,
                   "rules/reshaping.py",
                   "JAX's -1 inference divides by sizes that may be 0: the divisor splits"),
        TracePatch("jnp.squeeze (_squeeze)", lambda: (lax_numpy(), "_squeeze"),
                   "rules/reshaping.py",
                   "JAX refuses axis=None with symbolic sizes (the rank depends on which "
                   "are 1): each symbolic size's == 1 splits the trace"),
        TracePatch("lax.conv_general_dilated", lambda: (jax.lax, "conv_general_dilated"),
                   "rules/windows.py",
                   "JAX takes explicit padding as int pairs only (operator.index), though "
                   "its 'SAME' padding is symbolic: a size-dependent pair pads the input "
                   "with lax.pad instead"),
        TracePatch("jax._src.lax.convolution conv_general_dilated",
                   lambda: (_lax_convolution, "conv_general_dilated"), "rules/windows.py",
                   "the same, for JAX's own callers (lax.conv, conv_with_general_padding)"),
        TracePatch("lax.associative_scan", lambda: (jax.lax, "associative_scan"),
                   "rules/scans.py", "JAX recurses on the axis length in Python"),
        TracePatch("warnings.warn", lambda: (warnings, "warn"), "tracing/trace_warnings.py",
                   "not JAX's: a trace covers many sizes, so a warning a library raises on "
                   "a shape is said when a call reaches the case that raised it"),
        TracePatch("jnp.polyval", lambda: (jnp, "polyval"), "rules/numeric.py",
                   "JAX builds a Python list of the coefficients (lax.polynomial): a "
                   "symbolic number of them is Horner's rule as a scan instead, as JAX "
                   "wrote it before", jax="0.12"),
        TracePatch("jnp.array_equal", lambda: (jnp, "array_equal"), "rules/array_equality.py",
                   "JAX compares shapes structurally (False for two dim vars): a case split"),
        TracePatch("jnp.array_equiv", lambda: (jnp, "array_equiv"), "rules/array_equality.py",
                   "JAX refuses to broadcast two different dim vars: a case split"),
        TracePatch("jax._src.numpy array_equal", lambda: (lax_numpy(), "array_equal"),
                   "rules/array_equality.py", "the same, for JAX's internal calls"),
        TracePatch("jax._src.numpy array_equiv", lambda: (lax_numpy(), "array_equiv"),
                   "rules/array_equality.py", "the same, for JAX's internal calls"),
    )


TRACE_PATCHES: tuple[TracePatch, ...] = _splits_rows() + _rule_rows()
_BY_NAME = {p.name: p for p in TRACE_PATCHES}
_SPLIT_ROWS = frozenset(p.name for p in TRACE_PATCHES if p.replacement.startswith(_SPLITS))

_REPLACEMENTS: dict[str, Callable] = {}  # row name -> replacement (rule modules)
_REPLACEMENT_OF: dict[Callable, Callable] = {}  # the replaced JAX function -> replacement


def trace_patch(name: str) -> TracePatch:
    """The row ``name`` of the table (``KeyError`` names the missing row)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no row {name!r} in _jax_compat/patches.py's TRACE_PATCHES: "
                       "add one (what, why, JAX versions) before replacing it") from None


def replace_during_trace(name: str, replacement: Callable) -> None:
    """Install ``replacement`` at row ``name``'s home while a masked trace runs.

    For JAX functions that refuse symbolic sizes before binding any primitive
    (``lax.associative_scan``): the replacement must fall back to the original
    outside a masked trace, since other threads see it too.
    """
    row = trace_patch(name)
    if name in _SPLIT_ROWS:
        raise ValueError(f"row {name!r} is installed by splits.trace_hooks")
    _REPLACEMENTS[name] = replacement
    if hasattr(replacement, "__code__"):
        TRACE_REPLACEMENT_CODES.add(replacement.__code__)
    _REPLACEMENT_OF[row.current()] = replacement


def replacement_of(fun: Callable) -> Callable:
    """``fun``'s trace replacement when ``fun`` is (a ``functools.partial`` of) a
    replaced JAX function itself: a reference taken before the trace
    (``polymask.jit(jnp.trim_zeros, ...)``) is not looked up on the module."""
    inner = fun.func if isinstance(fun, functools.partial) else fun
    try:
        replacement = _REPLACEMENT_OF.get(inner)
    except TypeError:  # an unhashable callable
        return fun
    if replacement is None:
        return fun
    if isinstance(fun, functools.partial):
        return functools.partial(replacement, *fun.args, **fun.keywords)
    return replacement


@contextlib.contextmanager
def during_masked_trace(is_user_frame, split_vars: dict | None = None,
                        scope=None) -> Iterator[Any]:
    """Every row of the table installed for the duration of one masked trace:
    ``splits.trace_hooks`` (see there for the arguments; yields its record)
    and the rule modules' replacements."""
    with contextlib.ExitStack() as stack:
        record = stack.enter_context(trace_hooks(is_user_frame, split_vars, scope))
        for name, replacement in _REPLACEMENTS.items():
            stack.enter_context(patched_attr(*trace_patch(name).home(), replacement))
        yield record
