"""polymask: run JAX programs on variable-size data without recompiling per shape.

A value is a *padded array* plus its *logical shape*; ``mask(f)`` turns ``f``
(written for exact arrays) into a function of padded arrays whose logical
outputs equal ``f`` on the unpadded inputs. See docs/DESIGN.md for the contract.
"""

from __future__ import annotations

import sys as _sys

from . import rules as _rules  # noqa: F401  (registers the masking rules)
from .core import buckets
from .core.errors import (
    FailsAsPlainJax,
    FallbackWarning,
    PackedLayoutWarning,
    ShapeError,
    SpecError,
    TooManyCases,
    UnsupportedError,
)
from .core.masked import Masked, logical_shape, pad, stack
from .inspection.explain import explain
from .inspection.formula import shape_formula
from .ops import (
    arange,
    argwhere,
    boolean_mask,
    compress,
    dynamic_slice,
    extract,
    flatnonzero,
    nonzero,
    unique,
    where,
)
from .packing import PackedUnsupported
from .runners.compile_cache import (
    default_cache_dir,
    disable_compilation_cache,
    enable_compilation_cache,
)
from .runners.compiling import compile_counter
from .runners.hostmem import reuse_host_memory
from .runners.polyjit import jit
from .runners.ragged import ragged_map
from .runners.training import value_and_grad
from .tracing.prologue import shape_errors
from .tracing.transform import mask

# ``polymask.buckets`` is public (README: ``from polymask.buckets import pow2``);
# its code lives in the masking core, so the name is an alias of that module.
_sys.modules[__name__ + ".buckets"] = buckets

__all__ = [
    "Masked", "pad", "stack", "mask", "logical_shape", "ShapeError", "SpecError", "TooManyCases",
    "FailsAsPlainJax", "UnsupportedError",
    "nonzero", "argwhere", "flatnonzero", "where", "boolean_mask", "compress", "extract",
    "unique", "arange", "dynamic_slice", "shape_formula", "explain", "jit", "ragged_map",
    "buckets", "value_and_grad", "enable_compilation_cache", "disable_compilation_cache",
    "default_cache_dir", "compile_counter", "reuse_host_memory", "shape_errors",
    "PackedUnsupported", "FallbackWarning", "PackedLayoutWarning",
]
__version__ = "0.1.0"
