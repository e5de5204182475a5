"""LoRARequest: which adapter a request runs under, named as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``)
    at ``lora_path`` (a directory or a Hub id); ``lora_int_id`` (>= 1) is its identity in the
    engine: the prefix cache and the device slots are keyed by it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}"
            )
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
