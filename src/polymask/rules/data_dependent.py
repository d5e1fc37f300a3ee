"""Masking rules: data_dependent (filled in by its issue)."""
