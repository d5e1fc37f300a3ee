"""Masking rules: indexing (filled in by its issue)."""
