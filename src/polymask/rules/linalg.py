"""Masking rules: linalg (filled in by its issue)."""
