"""Converters of a built model's cell tree, which leave the model's code as it is:

    twins.py      the mechanism: a cell replaced in its parent by a twin sharing its Parameters (the CPU kernels'
                  overlay, LoRA); sharding.py: how a twin's own sub-cells follow their base's tensor-parallel split
    none.py       PEFT methods (the `peft` config group, base/peft.py's contract): `none` trains every weight,
    lora.py       `lora` adds LoRA adapters and freezes the rest

Importing this package registers the PEFT methods in base/registry.py PEFT; the layers that use one ask
`method(cfg.peft.name)`, never a method by name."""
from adapters import lora, none
from base.peft import PeftMethod
from base.registry import PEFT

PEFT.add("none", none)
PEFT.add("lora", lora)


def method(name: str) -> PeftMethod:
    """The PEFT method `peft.name` names (a ConfigError naming the choices for an unknown one)."""
    return PEFT[name]
