"""Triton kernels and their launch helpers (PDL), one module per kernel family.

Each module imports Triton; this package does not, so that machines without it can import
what names the kernels.
"""
