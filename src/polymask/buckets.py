"""Bucketing policies (filled in by the runner issue)."""

from __future__ import annotations


def as_policy(buckets):
    """A callable ``size -> bound`` from a policy spec."""
    if callable(buckets):
        return buckets
    raise NotImplementedError("bucketing policies are not implemented yet")
