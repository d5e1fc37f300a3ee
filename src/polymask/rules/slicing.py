"""Masking rules: slice, rev, pad, concatenate (strided/indexing issue)."""
