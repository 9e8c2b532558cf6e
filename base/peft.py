"""The PEFT-method contract: what a PEFT module (adapters/<name>.py) must and may provide, checked when it registers
(base/registry.py PEFT), as base/family.py is for model families. The trainer, evaluation, validation, the dry run
and the converter ask the method `peft.name` names; none of them knows LoRA.

    Config               its typed `peft` group (base/schema.py)
    check                check(cfg): its config rules, a ConfigError naming the key (base/validate.py)
    apply                apply(model, cfg) -> Adapters, the built model converted and its base frozen (trainer/loop.py,
                         evaluation/model.py); None: the model trains whole
    merge                merge(weights, cfg.peft) -> plain base weights with the adapters folded in (models/convert.py)
    export               export(weights, cfg.peft, to_hf, base_model_dir, out_dir): the adapters in Hugging Face
                         PEFT's format, named by the family's to_hf (models/convert.py)
    adapter_parameters   adapter_parameters(linears, peft, default_targets) -> the parameters it adds (the dry run)

Which cells a method adapts by default is the model family's declaration (base/family.py LORA_TARGETS).
"""
from typing import NamedTuple, Optional, Set

from base.family import ContractError, bind

REQUIRED = ("Config", "check", "apply")
OPTIONAL = ("merge", "export", "adapter_parameters")


class Adapters(NamedTuple):
    """What a PEFT run's checkpoints hold: the names of the weights it trains (the adapters, and any head its
    objective adds), the adapter_config.json written beside them (None: none written), and the line the trainer
    prints about them."""
    names: Set[str]
    config: Optional[dict]
    summary: str = ""


class PeftMethod:
    """A registered PEFT module: its members by their contract names, the optional ones None where absent."""

    def __init__(self, name: str, module):
        missing = [key for key in REQUIRED if not hasattr(module, key)]
        if missing:
            raise ContractError(f"PEFT method {name!r} ({module.__name__}) lacks {', '.join(missing)}: a PEFT method "
                                "provides what base/peft.py REQUIRED lists (docs/extending.md)")
        bind(self, name, module, REQUIRED, OPTIONAL)
