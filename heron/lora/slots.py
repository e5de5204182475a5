"""AdapterSlots: the adapters a runner knows, in host memory and in its layers' device slots."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from heron.lora.adapter import LoRAPair, read_peft_adapter
from heron.lora.config import LoRAConfig
from heron.lora.experts import LoRAExperts
from heron.lora.layer import LoRALinear
from heron.lora.request import LoRARequest

# An adapter's pairs by the model's layer name, then by part of that layer (None: unpacked;
# an expert bank's: its stack).
LayerPairs = dict[str, dict[str | None, LoRAPair]]


class AdapterSlots:
    """Read adapters stay in host memory (the ``max_cpu_loras`` used last); each step's
    adapters are put in device slots first (:meth:`assign`), taking a free slot or the one
    used longest ago among those the step does not use. ``packed`` maps a checkpoint module
    name to its packed layer and part (``q_proj`` -> ``qkv_proj``, ``q``), ``renames`` a
    checkpoint module name to the model's (``shared_experts`` -> ``shared_expert``)."""

    def __init__(
        self,
        layers: Mapping[str, LoRALinear | LoRAExperts],
        config: LoRAConfig,
        packed: Mapping[str, tuple[str, str]],
        renames: Mapping[str, str] | None = None,
    ) -> None:
        self.layers, self.config, self.packed = dict(layers), config, dict(packed)
        self.renames = dict(renames or {})
        self._requests: dict[int, LoRARequest] = {}  # every adapter known, by its id
        self._host: OrderedDict[int, LayerPairs] = OrderedDict()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # resident ones, last used last
        self._free = list(range(config.max_loras, 0, -1))

    def add(self, request: LoRARequest) -> None:
        """Read and check ``request``'s adapter (once per id); raises ``ValueError`` naming
        what does not fit the model."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} "
                f"({known.lora_path}), not {request.lora_name!r} ({request.lora_path})"
            )
        self._pairs(request)
        self._requests[request.lora_int_id] = request

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter: its host copy and its slot (it is read again if asked for)."""
        self._requests.pop(lora_int_id, None)
        self._host.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free.append(slot)

    def assign(self, requests: Sequence[LoRARequest | None]) -> np.ndarray:
        """Each row's slot (0: no adapter), the rows' adapters made resident first."""
        needed = {r.lora_int_id: r for r in requests if r is not None}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(
                f"a step of {len(needed)} adapters, more than max_loras={self.config.max_loras}"
            )
        for lora_id, request in needed.items():
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            slot = self._free.pop() if self._free else self._evict(needed)
            pairs = self._pairs(request)
            for name, layer in self.layers.items():
                layer.set_slot(slot, pairs.get(name, {}))
            self._slot_of[lora_id] = slot
        slot_of = self._slot_of
        return np.array([0 if r is None else slot_of[r.lora_int_id] for r in requests], np.int32)

    def _evict(self, needed: Mapping[int, LoRARequest]) -> int:
        victim = next(i for i in self._slot_of if i not in needed)
        return self._slot_of.pop(victim)

    def _pairs(self, request: LoRARequest) -> LayerPairs:
        """The adapter's pairs by layer and part, read (and checked) if not in host memory."""
        lora_id = request.lora_int_id
        pairs = self._host.get(lora_id)
        if pairs is None:
            pairs = self._host[lora_id] = self._map(request)
            while len(self._host) > self.config.cpu_capacity:
                self._host.popitem(last=False)
        self._host.move_to_end(lora_id)
        return pairs

    def _map(self, request: LoRARequest) -> LayerPairs:
        adapter = read_peft_adapter(
            request,
            self.config.max_lora_rank,
            lambda module: isinstance(self.layers.get(self._renamed(module)), LoRAExperts),
        )
        out: LayerPairs = {}
        for module, pair in adapter.pairs.items():
            parent, _, leaf = self._renamed(module).rpartition(".")
            if isinstance(self.layers.get(parent), LoRAExperts):  # a stack of its experts
                name, part = parent, leaf
            else:
                layer_leaf, part = self.packed.get(leaf, (leaf, None))
                name = f"{parent}.{layer_leaf}" if parent else layer_leaf
            layer = self.layers.get(name)
            if layer is None:
                why = "LoRA is not supported on it"
            elif part in out.get(name, {}):
                why = f"a second pair for {part or name}"
            else:
                why = layer.check(part, pair)
            if why is not None:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r}: target module {module!r}: {why}"
                )
            out.setdefault(name, {})[part] = pair
        return out

    def _renamed(self, module: str) -> str:
        """The model's name of checkpoint module ``module``."""
        return ".".join(self.renames.get(p, p) for p in module.split("."))
