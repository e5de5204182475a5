"""The routes an RL trainer drives a server with (``--enable-sleep-mode``): sleep and wake-up,
weight reloads, pause and resume, prefix cache reset; each a control call into the engine
core (:meth:`EngineCoreClient.control`), guarded by the API key like /v1."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict

from heron.engine.core_client import EngineCoreClient


class UpdateWeightsFromDisk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str | None = None  # a checkpoint directory; None: the served model's


class InitWeightUpdateGroup(BaseModel):
    """A trainer's process group to join (it is rank 0; see ``LLM.init_weight_update_group``)."""

    model_config = ConfigDict(extra="forbid")

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "nccl"


class UpdateWeightsFromDistributed(BaseModel):
    """One chunk of tensors the trainer broadcasts, one per name, in this order."""

    model_config = ConfigDict(extra="forbid")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    draft: bool = False


def rollout_router(engine: EngineCoreClient, parse, dependencies: list) -> APIRouter:
    """The routes; ``parse(request, model)`` reads a body, as the OpenAI routes do."""
    router = APIRouter(dependencies=dependencies)

    @router.post("/sleep")
    async def sleep(level: int = 1, abort: bool = False) -> dict:
        aborted = await engine.control("sleep", level=level, abort=abort)
        return {"success": True, "num_aborted": aborted}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict:
        await engine.control("wake_up", tags=tags)
        return {"success": True}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": await engine.control("is_sleeping")}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict:
        body = await parse(request, UpdateWeightsFromDisk)
        written = await engine.control("reload_weights", path=body.model_path)
        return {"success": True, "num_tensors": written}

    @router.post("/init_weight_update_group")
    async def init_weight_update_group(request: Request) -> dict:
        body = await parse(request, InitWeightUpdateGroup)
        await engine.control("init_weight_update_group", **body.model_dump())
        return {"success": True}

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> dict:
        body = await parse(request, UpdateWeightsFromDistributed)
        written = await engine.control("update_weights_from_distributed", **body.model_dump())
        return {"success": True, "num_tensors": written}

    @router.post("/pause_generation")
    async def pause_generation(mode: str = "abort") -> dict:
        aborted = await engine.control("pause_generation", mode=mode)
        return {"success": True, "num_aborted": aborted}

    @router.post("/resume_generation")
    async def resume_generation() -> dict:
        await engine.control("resume_generation")
        return {"success": True}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"success": await engine.control("reset_prefix_cache")}

    return router
