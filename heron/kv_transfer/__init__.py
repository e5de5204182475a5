"""KV connectors: the interface (scheduler and worker sides), the layer step counter, the
host-memory offload connector and the NIXL prefill/decode connector."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from heron.cache.layout import CacheLayout
from heron.cache.paged import PagedSpec
from heron.cache.recurrent import RecurrentStateSpec
from heron.config import KVTransferConfig
from heron.kv_transfer.base import (
    ExternalHits,
    KVConnectorMeta,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferError,
    TransferResults,
    refuse_specs,
)
from heron.kv_transfer.layer_steps import LayerSteps
from heron.kv_transfer.nixl import READ_FAILURES, TRANSFER_MODES, NixlScheduler, NixlWorker
from heron.kv_transfer.nixl_agent import NixlAgent
from heron.kv_transfer.nixl_push import Pusher
from heron.kv_transfer.offload import CheckpointTier, OffloadScheduler, OffloadWorker

__all__ = [
    "ExternalHits",
    "KVConnectorMeta",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransferError",
    "LayerSteps",
    "TransferResults",
    "make_connector",
]


def make_connector(
    config: KVTransferConfig, layout: CacheLayout, block_size: int, num_blocks: Sequence[int]
) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """The connector ``config`` names, for a model of cache ``layout`` (``num_blocks``: each
    group's device pool); raises ``ValueError`` naming what it cannot serve (a cache kind, a
    role, an option)."""
    if config.kv_connector == "offload":
        return _offload(config, layout, block_size, num_blocks)
    if config.kv_connector == "nixl":
        return _nixl(config, layout, block_size)
    raise ValueError(f"kv_transfer_config: no connector {config.kv_connector!r}")


def _offload(
    config: KVTransferConfig, layout: CacheLayout, block_size: int, num_blocks: Sequence[int]
) -> tuple[OffloadScheduler, OffloadWorker]:
    if config.kv_role != "kv_both":
        raise ValueError(
            f"kv_transfer_config: the 'offload' connector saves and loads (kv_role "
            f"'kv_both'), got kv_role {config.kv_role!r}"
        )
    options = _extra_options(
        config.kv_connector_extra_config,
        {"num_bytes": int, "load_timeout_s": float},
        {"load_timeout_s": 30.0},
    )
    refuse_specs("offload", layout.specs, (PagedSpec, RecurrentStateSpec))
    num_bytes, specs, per_block = options["num_bytes"], layout.specs, layout.bytes_per_block()
    paged = [g for g, spec in enumerate(specs) if not spec.per_request]
    states = [g for g, spec in enumerate(specs) if spec.per_request]
    tier, state_bytes = None, 0
    if not paged:
        raise ValueError(
            "kv_transfer_config: the 'offload' connector keeps prefixes by their blocks; the "
            "model has no paged cache group"
        )
    if len(states) > 1:
        raise ValueError(
            f"kv_transfer_config: the 'offload' connector keeps the state checkpoints of one "
            f"recurrent cache group; cache group {states[1]} ({specs[states[1]].describe()}) "
            "is a second"
        )
    if states:  # the checkpoints get the share of the bytes they have on the device
        g = states[0]
        device_bytes = [n * b for n, b in zip(num_blocks, per_block)]
        state_bytes = num_bytes * device_bytes[g] // sum(device_bytes)
        tier = CheckpointTier(g, state_bytes // per_block[g], per_block[g])
        if tier.num_slots < 1:
            raise ValueError(
                f"kv_offload_bytes: {num_bytes} bytes hold no state checkpoint; checkpoints "
                f"get the device pool's share of them ({state_bytes} bytes), and one takes "
                f"{per_block[g]} bytes"
            )
    bytes_per_slot = sum(per_block[g] for g in paged)
    num_slots = (num_bytes - state_bytes) // bytes_per_slot
    if num_slots < 1:
        raise ValueError(
            f"kv_offload_bytes: {num_bytes} bytes hold no block; one block of every paged "
            f"cache layer takes {bytes_per_slot} bytes"
        )
    scheduler = OffloadScheduler(
        num_slots, block_size, bytes_per_slot, paged, tier, options["load_timeout_s"]
    )
    return scheduler, OffloadWorker(num_slots, 0 if tier is None else tier.num_slots)


def _nixl(
    config: KVTransferConfig, layout: CacheLayout, block_size: int
) -> tuple[NixlScheduler, NixlWorker]:
    if config.kv_role not in ("prefill", "decode"):
        raise ValueError(
            f"kv_transfer_config: the 'nixl' connector's kv_role is 'prefill' or 'decode', "
            f"got {config.kv_role!r}"
        )
    # Paged blocks of every kind (full, window, latent) move, and recurrent states (whole: a
    # state is written once, after the prompt, not layer by layer as it is computed).
    refuse_specs("nixl", layout.specs, (PagedSpec, RecurrentStateSpec))
    state_groups = frozenset(g for g, spec in enumerate(layout.specs) if spec.per_request)
    options = _extra_options(
        config.kv_connector_extra_config,
        {
            "hold_timeout_s": float,
            "transfer_timeout_s": float,
            "on_read_failure": READ_FAILURES,
            "kv_transfer_mode": TRANSFER_MODES,
        },
        {
            "hold_timeout_s": 120.0,
            "transfer_timeout_s": 30.0,
            "on_read_failure": "recompute",
            "kv_transfer_mode": "whole" if state_groups else "layerwise",
        },
    )
    mode = options["kv_transfer_mode"]
    if mode == "layerwise" and state_groups:
        g = min(state_groups)
        raise ValueError(
            f"kv_transfer_config: kv_connector_extra_config kv_transfer_mode 'layerwise' "
            f"cannot move cache group {g} ({layout.specs[g].describe()}): a recurrent state "
            "moves whole, after the prompt; give kv_transfer_mode 'whole'"
        )
    timeouts = options["hold_timeout_s"], options["transfer_timeout_s"]
    try:
        agent = NixlAgent(stale_s=2 * max(timeouts))
    except ImportError as e:
        raise ValueError(
            "kv_transfer_config: the 'nixl' connector needs the nixl package "
            "(pip install 'heron[pd]')"
        ) from e
    pusher = None
    if mode == "layerwise" and config.kv_role == "prefill":
        pusher = Pusher(agent, options["transfer_timeout_s"])
    scheduler = NixlScheduler(
        config.kv_role,
        agent,
        block_size,
        options["hold_timeout_s"],
        state_groups,
        options["on_read_failure"],
        mode,
        pusher,
    )
    return scheduler, NixlWorker(agent, options["transfer_timeout_s"], pusher)


def _extra_options(
    given: Mapping[str, Any],
    types: dict[str, type | tuple[str, ...]],
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A connector's ``kv_connector_extra_config``: every option of ``types`` of its type
    (an integer for a float one too), at least 1 (above 0 for a float), or one of its tuple's
    words; required unless ``defaults`` has it; no other."""
    unknown = sorted(set(given) - set(types))
    if unknown:
        raise ValueError(
            f"kv_transfer_config: unknown kv_connector_extra_config field(s) "
            f"{', '.join(map(repr, unknown))} (known: {', '.join(sorted(types))})"
        )
    options = dict(defaults or {})
    for name, kind in types.items():
        value = given.get(name, options.get(name))
        if value is None:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config {name!r} is required")
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(
                    f"kv_transfer_config: kv_connector_extra_config {name} must be one of "
                    f"{', '.join(map(repr, kind))}, got {value!r}"
                )
            options[name] = value
            continue
        accepted = (int, float) if kind is float else kind
        if (
            isinstance(value, bool)
            or not isinstance(value, accepted)
            or not (value > 0 if kind is float else value >= 1)
        ):
            raise ValueError(
                f"kv_transfer_config: kv_connector_extra_config {name} must be "
                f"{'a number > 0' if kind is float else 'an integer >= 1'}, got {value!r}"
            )
        options[name] = value
    return options
