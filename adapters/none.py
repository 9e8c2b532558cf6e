"""peft=none: full fine-tuning, every weight trains; the model is left as it is built."""
from dataclasses import dataclass


@dataclass
class Config:
    name: str = "none"  # full fine-tuning: every weight trains


def check(cfg) -> None:
    """No keys of its own to check."""


def apply(model, cfg) -> None:
    """Nothing to convert: the model trains whole, and its checkpoints hold every weight."""
