"""Parameter-efficient fine-tuning, applied to a built model as a converter (the `peft` config group):
`none` trains every weight, `lora` adds LoRA adapters and freezes the rest (adapters/lora.py)."""
from dataclasses import dataclass

from adapters.lora import LoraConfig
from base.registry import PEFT


@dataclass
class NoneConfig:
    name: str = "none"  # full fine-tuning: every weight trains


PEFT.add("none", NoneConfig)
PEFT.add("lora", LoraConfig)
