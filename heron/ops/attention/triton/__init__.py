"""Triton kernels for paged attention (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
