"""Data-dependent-size ops: nonzero, argwhere, flatnonzero, where, boolean_mask,
compress, unique, arange, dynamic_slice (filled in by the data-dependent issue)."""

from __future__ import annotations

__all__ = ["nonzero", "argwhere", "flatnonzero", "where", "boolean_mask", "compress",
           "extract", "unique", "arange", "dynamic_slice"]


def _todo(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"polymask.{name} is not implemented yet")

    fn.__name__ = name
    return fn


nonzero = _todo("nonzero")
argwhere = _todo("argwhere")
flatnonzero = _todo("flatnonzero")
where = _todo("where")
boolean_mask = _todo("boolean_mask")
compress = _todo("compress")
extract = _todo("extract")
unique = _todo("unique")
arange = _todo("arange")
dynamic_slice = _todo("dynamic_slice")
