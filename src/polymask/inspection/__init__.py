"""Inspection: ``shape_formula`` (``formula``) and ``explain`` (``explain``, with
its sizes table ``sizetable``): what a masked function does, read off its
symbolic trace and case tree.

Layer: imports ``_jax_compat``, ``core``, ``tracing``, ``rules`` (the rule
table, to attribute equations) and ``packing`` (``explain(layout="packed")``);
nothing above.
"""
