"""Every use of private JAX API lives in this package (tested range: jax 0.10.2 .. 0.12.x).

polymask needs a few internals of ``jax.export``'s symbolic shapes (dimension
expressions, their scope and bounds), of the jaxpr machinery (source info,
``dim_as_value``, JAX's rule tables) and of the runtime (host callbacks' logs,
device upload). Keeping them in one place means a JAX upgrade touches one
package; ``tests/test_jax_compat.py`` covers each function. Import it as
``from polymask import _jax_compat as compat``: the names below are its API.

- ``core``: symbolic shapes, jaxprs, source info, rule tables, primitive list
- ``versions``: what differs between the supported JAX versions (look here
  first on a JAX upgrade): jaxprs' constants, primitives' params, primitives
  present on some versions only, hijax primitives, JAX error wordings
- ``patches``: the table of every replacement of JAX behaviour while a masked
  trace runs (what, why, which JAX versions) and its switching on and off
  (look here on a JAX upgrade, with ``versions``)
- ``splits``: the hooks a masked trace installs in JAX's symbolic shapes while
  it runs (undecidable size comparisons raise ``SplitNeeded``; rows of
  ``patches``)
- ``hooks``: ``patched_attr``, ``quiet_callback_errors``
- ``runtime``: ``upload`` (host -> device without a program), ``buffer_address``, ``is_made``
- ``callbacks``: ``jax.debug.print``'s host formatting, the debug effects
- ``checks``: ``checkify.check``'s error value (its failure predicates)
- ``lowering``: lowering / transposition helpers of polymask's own primitives

Layer: the lowest; imports JAX only (no other polymask package).
"""

from .callbacks import *  # noqa: F401,F403
from .checks import *  # noqa: F401,F403
from .core import *  # noqa: F401,F403
from .core import (  # noqa: F401  (private names used by polymask modules)
    _POLYMASK_DIR,
)
from .hooks import *  # noqa: F401,F403
from .lowering import *  # noqa: F401,F403
from .patches import *  # noqa: F401,F403
from .runtime import *  # noqa: F401,F403
from .splits import *  # noqa: F401,F403
from .versions import *  # noqa: F401,F403
