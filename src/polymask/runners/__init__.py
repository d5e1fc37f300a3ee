"""The runners: exact arrays in, exact arrays out, one compiled program per bucket.

``polyjit`` (``polymask.jit``) and ``ragged`` (``ragged_map``, with
``ragged_batches``: which examples share a batch) plan a call, pad on the host
(``hostio``), look the compiled program up in the program cache (``programs``)
and run it; ``outputs`` says how each output gets its exact size back.
``tiering`` (a covering bucket while the tight one compiles) and ``refining``
(tighter programs compiled after a call) choose which program runs.
``compiling`` counts XLA compiles and runs background compiles;
``compile_cache`` is JAX's persistent compilation cache; ``program_store``
keeps ``ragged_map``'s programs on disk; ``envvars`` / ``hostmem``: the
``POLYMASK_*`` switches and glibc malloc settings; ``training``:
``value_and_grad`` over ragged batches.

Layer: imports ``_jax_compat``, ``core`` and ``tracing`` (``mask``); never
``models`` or ``cli``.
"""
