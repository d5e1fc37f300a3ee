"""polymask: run JAX programs on variable-size data without recompiling per shape.

A value is a *padded array* plus its *logical shape*; ``mask(f)`` turns ``f``
(written for exact arrays) into a function of padded arrays whose logical
outputs equal ``f`` on the unpadded inputs. See DESIGN.md for the contract.
"""

from __future__ import annotations

from . import rules as _rules  # noqa: F401  (registers the masking rules)
from .errors import ShapeError, UnsupportedError
from .interpreter import mask
from .masked import Masked, logical_shape, pad, stack

__all__ = [
    "Masked", "pad", "stack", "mask", "logical_shape", "ShapeError", "UnsupportedError",
]
__version__ = "0.1.0"
