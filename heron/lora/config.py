"""LoRAConfig: how many adapters the engine holds, and how large."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters fit a step (device slots 1..max_loras; slot 0 is the base
    model), each of rank at most ``max_lora_rank``; ``max_cpu_loras`` loaded adapters are kept
    in host memory (least recently used dropped first)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (
            isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}"
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras
