"""The Triton attention operator and its builder; its kernels live in ``heron.kernels``."""
