"""LoRA adapters: PEFT loading, the device slots, the LoRA layers and their metadata builder."""

from heron.lora.config import LoRAConfig
from heron.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
