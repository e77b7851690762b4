"""Triton kernels, each beside a plain-torch reference twin of the same signature."""
