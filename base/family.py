"""The model-family contract: what a family package (models/<family>/__init__.py) must and may provide, checked
when it registers (base/registry.py FAMILIES), as torchtitan's ModelSpec is. A family lacking a required member is
refused at import with one line naming every missing member; the registry then holds a `Family`, whose optional
members are None where the family has none, so the layers that use a family ask `fam.generator is not None`, never
the module by name.

    FamilyConfig        the `model` keys the framework reads whatever the family (a family's Config subclasses it)
    REQUIRED, OPTIONAL  the members, each with what reads it
    HF_REQUIRED, HF_OPTIONAL   the members of the family's Hugging Face adapter (`hf`)

The causal-LM interface the objectives and evaluation use on a built model (hidden states, the head, the auxiliary
loss) is models/common/causal_lm.py's `CausalLM`; a family whose `CAUSAL` is true builds one.
"""
from dataclasses import dataclass, is_dataclass
from typing import Optional

from omegaconf import MISSING

from base.errors import UserError


class ContractError(UserError):
    """A plug-in that lacks what its contract requires (one line: the plug-in and the missing members)."""


@dataclass
class FamilyConfig:
    """The `model` keys read outside the family: the schema, validation, the planner, the trainer and evaluation."""
    name: str = MISSING  # the preset's name
    family: str = MISSING  # models/<family>/
    vocab_size: int = MISSING  # the tokenizer's size (data, generation, the loss)
    hidden_size: int = MISSING  # the activations' width (the planner's activation and communication terms)
    num_layers: int = MISSING  # pipeline stages divide it (validation, the planner)
    num_heads: int = MISSING  # attention heads (the planner's [S, S] softmax term per head)
    max_position_embeddings: int = 2048  # the longest row served unless the family's context_window says more
    init_std: float = 0.02  # the normal init of the weights
    recompute: str = "none"  # none | full | selective (the family's recompute_cells; the planner's time and memory)
    flash_attention: Optional[bool] = None  # null: on where the device has the kernel; a family may refuse true


REQUIRED = {
    "Config": "its typed `model` group, a dataclass subclassing base.family.FamilyConfig (base/schema.py)",
    "CAUSAL": "true for a decoder (causal objectives, generation), false for an encoder",
    "build": "build(cfg, seq_len, compute_dtype, use_flash, seed, sharded) -> the model cell (models/__init__.py; "
             "sharded: leave the weights to the sharded compile, models.deferred_initialisation)",
    "check": "check(cfg): its config rules, a ConfigError naming the key (base/validate.py)",
    "describe": "describe(m, count) -> dry-run lines (planner/dry_run.py)",
    "recompute_cells": "recompute_cells(model, mode) -> the cells model.recompute redoes (models/__init__.py)",
    "attention_kind": "attention_kind(cfg, device, compute_dtype, sharded) -> flash | fused | plain (device: "
                      "the device preset, base/schema.py DeviceConfig: its capabilities decide)",
    "parameter_count": "parameter_count(m) -> {..., 'total'} (the dry run, the reference model), and 'lm_head' for "
                       "a CAUSAL family (what a reward model drops: objectives/rm.py, ppo.py)",
    "matmul_parameter_count": "matmul_parameter_count(m) -> the matmul weights one token runs through: the ACTIVE "
                              "parameters of a mixture of experts (6N of the FLOPs; the planner's time model)",
    "flops_per_token": "flops_per_token(m, seq_len) -> training FLOPs per token (MFU, the planner)",
    "stage_parameters": "stage_parameters(m, p) -> parameters one device of each pipeline stage holds",
    "layer_activation_factors": "layer_activation_factors(m) -> (replicated, tp-sharded) activations per layer",
    "hf": "its Hugging Face adapter (HF_REQUIRED; models/convert.py, parity/)",
}
OPTIONAL = {
    "generator": "generator(model) -> its text generator (models/generation.py); a family without one "
                 "does not generate",
    "context_window": "context_window(m) -> the longest row served, when not max_position_embeddings",
    "set_context_length": "set_context_length(model, length): what the model prepares for rows of `length`",
    "apply_kernels": "apply_kernels(model, cfg, compute_dtype, device, sharded): device / CPU-kernel twins",
    "linear_shapes": "linear_shapes(m) -> {path: (in, out)} of its linear cells (the dry run's LoRA count)",
    "LORA_TARGETS": "the linear cells peft=lora adapts when peft.target_modules is null (adapters/lora.py); a family "
                    "without it makes the run name them",
    "export_mindformers": "export_mindformers(cfg, weights, out_dir, location): convert.py --to mindformers",
    "experts": "experts(m) -> (num_experts, top_k) of a mixture of experts: parallel.ep splits them (validation, "
               "the planner's memory and all-to-all time, the advisor's search)",
    "after_step": "after_step(model, model_cfg): what the family updates outside the gradient after every step, "
                  "its update applied or skipped (DeepSeek-V3's routing bias, from the step's expert load; "
                  "trainer/callbacks.py FamilyUpdate)",
    "step_metrics": "step_metrics(model) -> {name: value} the console and metrics.jsonl show after each step "
                    "(a router's load and dropped tokens)",
}
HF_REQUIRED = {
    "ARCHITECTURES": "the config.json architectures it imports (models/convert.py picks the family by them)",
    "to_hf": "to_hf(weights) -> the Hugging Face state dict",
    "from_hf": "from_hf(weights, config) -> mindlab's names",
    "hf_config": "hf_config(m) -> config.json",
    "config_from_hf": "config_from_hf(config, where) -> the `model` keys",
    "save_tokenizer": "save_tokenizer(tokenizer_file, out_dir, chat_template)",
}
HF_OPTIONAL = {
    "save_generation_config": "save_generation_config(m, out_dir): generation_config.json of a family that generates",
    "REWARD_MODEL": "config.json keys of a reward model (objectives/rm.py's export)",
}


def bind(holder, name: str, module, required, optional) -> None:
    """`holder` takes the module's members by their contract names, the optional ones None where absent."""
    holder.name, holder.module, holder.__name__ = name, module, module.__name__
    for key in required:
        setattr(holder, key, getattr(module, key))
    for key in optional:
        setattr(holder, key, getattr(module, key, None))


class Family:
    """A registered family: the package's members by their contract names, the optional ones None where absent.
    `module` is the package (its `plan` submodule holds a tensor/pipeline plan, models/__init__.py plan_of)."""

    def __init__(self, name: str, module):
        missing = [key for key in REQUIRED if not hasattr(module, key)]
        hf = getattr(module, "hf", None)
        if hf is not None:
            missing += [f"hf.{key}" for key in HF_REQUIRED if not hasattr(hf, key)]
        config = getattr(module, "Config", None)
        if config is not None and not (is_dataclass(config) and issubclass(config, FamilyConfig)):
            missing.append("Config (a dataclass subclassing base.family.FamilyConfig)")
        if missing:
            raise ContractError(f"model family {name!r} ({module.__name__}) lacks {', '.join(missing)}: a family "
                                "provides what base/family.py REQUIRED lists (docs/extending.md)")
        bind(self, name, module, REQUIRED, OPTIONAL)
        self.hf = HfAdapter(hf)

    def __repr__(self) -> str:
        return f"Family({self.name!r}, {self.__name__})"


class HfAdapter:
    """A family's Hugging Face adapter, its optional members None where absent."""

    def __init__(self, module):
        for key in HF_REQUIRED:
            setattr(self, key, getattr(module, key))
        for key in HF_OPTIONAL:
            setattr(self, key, getattr(module, key, None))
