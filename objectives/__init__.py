"""Training objectives: each wraps a model into a cell (batch -> scalar fp32 loss)."""
from mindspore import nn

from conf.schema import ObjectiveConfig


def build_objective(cfg: ObjectiveConfig, model: nn.Cell) -> nn.Cell:
    if cfg.name == "clm":
        from objectives.clm import CausalLMLoss

        return CausalLMLoss(model, cfg.ignore_index)
    raise ValueError(f"objective={cfg.name!r} is not implemented; available: clm")
