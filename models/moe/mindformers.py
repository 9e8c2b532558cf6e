"""The export of a mixture-of-experts checkpoint to MindFormers 1.9: its `LlamaForCausalLM` with a `moe_config`
(MindFormers' Mixtral recipe, research/mixtral/, is this model), the weights renamed to MindFormers' parameter
names (the same shapes: experts stacked [E, f, h] / [E, h, f], the router [E, h]).

    model_config  LlamaConfig; intermediate_size is one routed expert's width
    moe_config    MoEConfig (mindformers/modules/transformer/moe.py): expert_num, num_experts_chosen (top_k),
                  capacity_factor (-1: dropless, MindFormers' "capacity_factor <= 0"), aux_loss_factor,
                  z_loss_factor, norm_topk_prob, routing_policy TopkRouterV2 (its Mixtral YAML's),
                  enable_sdrop false (drops by choice rank, first choices of all tokens first, as mindlab's capacity
                  mode: MindFormers' "kdrop"), shared_expert_num (the shared expert's width in routed experts'
                  widths) and use_shared_expert_gating; DeepSeek-V3's balancing as balance_via_topk_bias and
                  topk_bias_update_rate, the bias as its router's topk_bias
"""
import re
from typing import Optional

import numpy as np

from base.errors import ConfigError
from models.common.mindformers import llama_config, write

# mindlab's -> MindFormers' names inside a decoder layer; `{routed}` is "routed_experts." beside a shared expert
# (LlamaFeedForwardWithMoE) and "" without one (its MoE cell directly)
NAMES = ((r"feed_forward\.experts\.(w[123])$", r"feed_forward.{routed}ffn.\1.weight"),
         (r"feed_forward\.router\.weight$", r"feed_forward.{routed}router.dense.weight"),
         (r"feed_forward\.shared_expert\.(w[123])\.weight$", r"feed_forward.shared_experts.\1.weight"),
         (r"feed_forward\.shared_expert_gate\.weight$", r"feed_forward.shared_experts_gate.weight"),
         (r"feed_forward\.routing_bias$", r"feed_forward.{routed}router.router.topk_bias"),
         (r"feed_forward\.expert_load$", r"feed_forward.{routed}router.router.expert_load"))


def moe_config(m) -> dict:
    """MindFormers' MoEConfig keys of a `model` config; what it cannot say is refused naming the key."""
    if not 0 < m.aux_loss_coef < 1:
        raise ConfigError("model.aux_loss_coef", f"{m.aux_loss_coef}: MindFormers' MoEConfig takes an "
                          "aux_loss_factor in (0, 1); export a model trained with one")
    shared, width = m.shared_expert_intermediate_size, m.expert_intermediate_size
    if shared % width:
        raise ConfigError("model.shared_expert_intermediate_size", f"{shared} is not a multiple of "
                          f"model.expert_intermediate_size={width}: MindFormers sizes its shared expert as "
                          "shared_expert_num routed experts' widths")
    return {"expert_num": m.num_experts, "num_experts_chosen": m.top_k,
            "capacity_factor": -1.0 if m.capacity_factor is None else float(m.capacity_factor),
            "aux_loss_factor": float(m.aux_loss_coef), "z_loss_factor": float(m.z_loss_coef),
            "norm_topk_prob": bool(m.norm_topk_prob), "routing_policy": "TopkRouterV2", "enable_sdrop": False,
            "router_dense_type": "float32", "shared_expert_num": shared // width,
            "use_shared_expert_gating": bool(m.shared_expert_gate),
            "balance_via_topk_bias": m.bias_update_rate > 0, "topk_bias_update_rate": float(m.bias_update_rate)}


def mindformers_names(weights: dict, shared: bool) -> dict:
    """The weights under MindFormers' names (the router statistics, not a weight, left out)."""
    routed = "routed_experts." if shared else ""
    out = {}
    for name, value in weights.items():
        if name.endswith("router_stats"):
            continue
        if name.endswith("expert_load"):  # MindFormers sums the loads since its last bias update: none yet
            value = np.zeros_like(value)
        for pattern, replacement in NAMES:
            if re.search(pattern, name):
                name = re.sub(pattern, replacement.format(routed=routed), name)
                break
        out[name] = value
    return out


def export_checkpoint(cfg, weights: dict, out_dir: str, location: Optional[str] = None) -> None:
    """`llama.ckpt` under MindFormers' names and `llama_mindlab.yaml` with the model_config and moe_config."""
    m = cfg.model
    config = moe_config(m)
    write(mindformers_names(weights, m.shared_expert_intermediate_size > 0), out_dir, location,
          llama_config(cfg, m.expert_intermediate_size), moe_config=config)
