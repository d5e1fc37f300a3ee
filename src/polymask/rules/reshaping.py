"""Masking rules: fragmenting reshapes and splits (control-flow/reshape issue)."""
