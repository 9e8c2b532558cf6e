"""Model families: one folder each (models/<family>/), found by `model.family`. Importing this package registers
every family folder in base/registry.py FAMILIES, so a new family is its folder (and its conf/model presets) and
nothing else.

What a family package provides, required and optional, is base/family.py's contract, checked when it registers
(a ContractError naming what is missing); the registry holds it as a base/family.py `Family`, its optional members
None where the family has none. Blocks several families share (attention, RMSNorm, RoPE, SwiGLU, the causal-LM
interface) are models/common/; a family's `plan` submodule holds its tensor/pipeline layout.
"""
import importlib
import pkgutil
from types import ModuleType

from base.family import Family
from base.registry import FAMILIES
from base.schema import as_device, use_flash_attention

for _info in pkgutil.iter_modules(__path__):
    if _info.ispkg and _info.name != "common":  # the family packages are cheap to import (no MindSpore)
        FAMILIES.add(_info.name, importlib.import_module(f"models.{_info.name}"))


def family(name: str) -> Family:
    """The family package named by `model.family` (a ConfigError naming the choices for an unknown one)."""
    return FAMILIES[name]


def plan_of(name: str) -> ModuleType:
    """The family's tensor/pipeline plan, models/<family>/plan.py (imports MindSpore)."""
    return importlib.import_module(family(name).__name__ + ".plan")


def attention_kind(cfg, device, compute_dtype: str, sharded: bool) -> str:
    """flash, fused (a family's own CPU kernel) or plain: the family's `attention_kind` (the first two keep no
    [S, S] probabilities for the backward: the dry-run planner's activation term). `device`, `sharded`: as
    build_model's."""
    return family(cfg.family).attention_kind(cfg, as_device(device), compute_dtype, sharded)


def build_model(cfg, seq_len: int, compute_dtype: str, device, seed: int, sharded: bool = False):
    """The family's model, its CPU kernels swapped in where they apply (the family's `apply_kernels`, decided from
    these arguments: never from MindSpore's global context), then `cfg.recompute` applied: full recomputes each
    layer in the backward, selective only its attention core. `sharded`: the model runs under a semi-auto
    tensor/pipeline layout (base.schema.is_sharded), whose plan sets its strategies on the plain ops, and whose
    weights the sharded compile initialises, each rank only its slices (deferred_initialisation). `device`: the
    run's device preset (cfg.device), whose capabilities decide, or a target name standing for its preset."""
    fam, device = family(cfg.family), as_device(device)
    with deferred_initialisation(sharded):
        model = fam.build(cfg, seq_len, compute_dtype, use_flash_attention(cfg, device), seed, sharded)
    if fam.apply_kernels is not None:
        fam.apply_kernels(model, cfg, compute_dtype, device, sharded)
    if cfg.recompute != "none":
        for cell in fam.recompute_cells(model, cfg.recompute):
            cell.recompute()
    return model


def deferred_initialisation(sharded: bool):
    """A context in which the parameters made from MindSpore initializers (a sharded build's weights, an optimizer's
    moments, a step's accumulation buffers) hold no data until the semi-auto compile initialises each rank's
    slices (MindSpore's no_init_parameters, the pattern its AutoParallel documents); a no-op when not `sharded`."""
    import contextlib

    from mindspore.nn.utils import no_init_parameters

    return no_init_parameters() if sharded else contextlib.nullcontext()


def context_window(cfg) -> int:
    """The longest sequence a model of `cfg` serves (the family's `context_window`, else max_position_embeddings)."""
    fam = family(cfg.family)
    return fam.context_window(cfg) if fam.context_window is not None else int(cfg.max_position_embeddings)


def set_context_length(family_name: str, model, length: int) -> None:
    """Prepare `model` for rows of `length` tokens where its family needs to (`set_context_length`)."""
    fam = family(family_name)
    if fam.set_context_length is not None:
        fam.set_context_length(model, length)
