"""The nixl connector's engines of a test, shut down after it: until then each one's NIXL
agent keeps a UCX progress thread polling a core, which would starve the rest of the suite."""

from __future__ import annotations

import pytest
from test_offload import SMALL

from heron.config import EngineConfig
from heron.engine.llm_engine import LLMEngine


@pytest.fixture
def nixl_engine():
    """Factory: an engine of the model at ``path`` with the nixl connector in ``role``
    (``extra``: its ``kv_connector_extra_config``; ``options``: the engine's, else SMALL)."""
    engines: list[LLMEngine] = []

    def make(path, role: str, extra: dict | None = None, **options) -> LLMEngine:
        nixl = {"kv_connector": "nixl", "kv_role": role, "kv_connector_extra_config": extra or {}}
        engine = LLMEngine(EngineConfig(str(path), kv_transfer_config=nixl, **(options or SMALL)))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
