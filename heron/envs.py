"""Every environment variable Heron reads, in one place (each is documented in the README).

Read when asked, not at import, so a test or a launcher that sets one first is seen.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``HERON_CACHE_DIR``: where converted GGUF models are kept; else
    ``$XDG_CACHE_HOME/heron``, else ``~/.cache/heron``."""
    if root := os.environ.get("HERON_CACHE_DIR"):
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "heron"


def _switch(name: str) -> bool:
    """An on-by-default switch: any value but ``0`` leaves it on."""
    return os.environ.get(name, "1") != "0"


def pdl() -> bool:
    """``HERON_PDL=0``: no programmatic dependent launch on Hopper and newer (to compare)."""
    return _switch("HERON_PDL")


def gdn_fused_decode() -> bool:
    """``HERON_GDN_FUSED=0``: gated-delta-rule decode in two kernels and a norm instead of
    one fused launch (to compare)."""
    return _switch("HERON_GDN_FUSED")


def _number(name: str, default: float) -> float:
    """A positive number; a bad value fails naming the variable."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(f"{name}={value!r}: give a positive number")
    return number


def responses_store_size() -> int:
    """``HERON_RESPONSES_STORE_SIZE``: how many finished responses ``/v1/responses`` keeps for
    ``previous_response_id`` (default 1000; the oldest go first)."""
    return int(_number("HERON_RESPONSES_STORE_SIZE", 1000))


def responses_store_max_age_s() -> float:
    """``HERON_RESPONSES_STORE_MAX_AGE_S``: how long a stored response is kept (default 3600)."""
    return _number("HERON_RESPONSES_STORE_MAX_AGE_S", 3600)


def max_pooling_inputs() -> int:
    """``HERON_MAX_POOLING_INPUTS``: the most inputs one pooling request (``/v1/embeddings``,
    ``/score``, ``/rerank``, ...) may carry (default 2048)."""
    return int(_number("HERON_MAX_POOLING_INPUTS", 2048))
