"""Masking rules: windows (filled in by its issue)."""
