"""The mixture-of-experts family's Hugging Face adapter: Mixtral (`MixtralForCausalLM`: no shared expert, top-k
renormalised) or Qwen2-MoE (`Qwen2MoeForCausalLM`: a sigmoid-gated shared expert, norm_topk_prob either way, no
q/k/v bias), whichever the config is (`architecture`). The attention, norms, embedding and head are named as the
Llama family's (models/common/hf.py); the routed experts, stacked here ([E, f, h]), are one Linear per expert there:

    feed_forward.router.weight          block_sparse_moe.gate.weight            mlp.gate.weight
    feed_forward.experts.w1 [E, f, h]   block_sparse_moe.experts.{j}.w1.weight  mlp.experts.{j}.gate_proj.weight
    feed_forward.experts.w3 [E, f, h]   block_sparse_moe.experts.{j}.w3.weight  mlp.experts.{j}.up_proj.weight
    feed_forward.experts.w2 [E, h, f]   block_sparse_moe.experts.{j}.w2.weight  mlp.experts.{j}.down_proj.weight
    feed_forward.shared_expert.w1/w3/w2                                         mlp.shared_expert.gate/up/down_proj
    feed_forward.shared_expert_gate                                             mlp.shared_expert_gate.weight

DeepSeek-MoE's ungated shared experts have no transformers class with Llama's attention: export refuses them.
"""
import re
from typing import Dict

import numpy as np

from base.errors import ConfigError, UserError
from models.common.hf import BOS_ID, DECODER_NAMES, EOS_ID, PAD_ID, _rename, save_tokenizer  # noqa: F401

ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")  # config.json architectures this adapter imports
STATS = "model.router_stats"  # the console's router statistics (models/moe/model.py): not a weight
EXPERT = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(w[123])")
NAMES = {  # per architecture: the feed-forward's names, {i} the layer
    "MixtralForCausalLM": {"model.layers.{i}.feed_forward.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight"},
    "Qwen2MoeForCausalLM": {
        "model.layers.{i}.feed_forward.router.weight": "model.layers.{i}.mlp.gate.weight",
        "model.layers.{i}.feed_forward.shared_expert.w1.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "model.layers.{i}.feed_forward.shared_expert.w3.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        "model.layers.{i}.feed_forward.shared_expert.w2.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        "model.layers.{i}.feed_forward.shared_expert_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight"},
}
EXPERT_NAMES = {"MixtralForCausalLM": ("block_sparse_moe.experts.{j}.", {"w1": "w1", "w3": "w3", "w2": "w2"}),
                "Qwen2MoeForCausalLM": ("mlp.experts.{j}.", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})}


def architecture(m) -> str:
    """The transformers class of a config: Mixtral without a shared expert (top-k renormalised), Qwen2-MoE with a
    gated one; a ConfigError naming the key otherwise."""
    if m.bias_update_rate > 0:
        raise ConfigError("model.bias_update_rate", "a routing bias (DeepSeek-V3's balancing) has no place in "
                          "Mixtral or Qwen2-MoE, whose routers choose by the probabilities alone; export it with "
                          "--to mindformers (balance_via_topk_bias)")
    if not m.shared_expert_intermediate_size:
        if not m.norm_topk_prob:
            raise ConfigError("model.norm_topk_prob", "Mixtral renormalises the top-k weights and has no shared "
                              "expert: set model.norm_topk_prob=true, or add a gated shared expert (Qwen2-MoE)")
        return "MixtralForCausalLM"
    if not m.shared_expert_gate:
        raise ConfigError("model.shared_expert_gate", "an ungated shared expert (DeepSeek-MoE) has no transformers "
                          "class with this attention; set model.shared_expert_gate=true (Qwen2-MoE) to export")
    return "Qwen2MoeForCausalLM"


def _table(arch: str) -> Dict[str, str]:
    return {**DECODER_NAMES, **NAMES[arch]}


def _arch_of(weights) -> str:
    return "Qwen2MoeForCausalLM" if any(".shared_expert" in k for k in weights) else "MixtralForCausalLM"


def to_hf(weights: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Hugging Face names (the architecture told by the weights: a shared expert is Qwen2-MoE's), each stacked
    expert tensor split into its experts' Linears."""
    arch = _arch_of(weights)
    prefix, linear = EXPERT_NAMES[arch]
    out = {}
    for name, value in weights.items():
        match = EXPERT.fullmatch(name.removesuffix(".weight"))
        if name == STATS:
            continue
        if match:
            layer, which = match.groups()
            for j in range(value.shape[0]):
                out[f"model.layers.{layer}.{prefix.format(j=j)}{linear[which]}.weight"] = value[j]
        else:
            out[_rename(name, _table(arch))] = value
    return out


def from_hf(weights: Dict[str, np.ndarray], hf: dict) -> Dict[str, np.ndarray]:
    """mindlab's names, the experts stacked; a tied model's stored lm_head copy dropped."""
    arch = hf["architectures"][0]
    tied = bool(hf.get("tie_word_embeddings", False))
    prefix, linear = EXPERT_NAMES[arch]
    back = {hf_name: ml for ml, hf_name in _table(arch).items()}
    pattern = re.compile(r"model\.layers\.(\d+)\." + re.escape(prefix).replace(r"\{j\}", r"(\d+)")
                         + "(" + "|".join(linear.values()) + r")\.weight")
    ours = {v: k for k, v in linear.items()}
    experts: Dict[tuple, Dict[int, np.ndarray]] = {}
    out = {}
    for name, value in weights.items():
        match = pattern.fullmatch(name)
        if match:
            layer, j, which = match.groups()
            experts.setdefault((layer, ours[which]), {})[int(j)] = value
        elif ".self_attn." in name and name.endswith(".bias"):
            if np.any(np.asarray(value)):
                raise UserError(f"{name}: a q/k/v bias (Qwen2-MoE qkv_bias) has no place in mindlab's attention; "
                                "import a model without attention biases")
        elif not (tied and name == "lm_head.weight"):
            out[_rename(name, back)] = value
    for (layer, which), by_index in experts.items():
        out[f"model.layers.{layer}.feed_forward.experts.{which}"] = np.stack([by_index[j] for j in sorted(by_index)])
    return out


def hf_config(m) -> dict:
    """config.json for a mindlab MoE config (Mixtral's or Qwen2-MoE's fields: `architecture`)."""
    arch = architecture(m)
    config = dict(architectures=[arch], vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                  max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                  tie_word_embeddings=m.tie_embeddings, hidden_act="silu", num_experts_per_tok=m.top_k,
                  router_aux_loss_coef=m.aux_loss_coef, initializer_range=m.init_std, torch_dtype="float32",
                  pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    if arch == "MixtralForCausalLM":
        config.update(model_type="mixtral", intermediate_size=m.expert_intermediate_size,
                      num_local_experts=m.num_experts, sliding_window=None)
    else:
        config.update(model_type="qwen2_moe", intermediate_size=m.expert_intermediate_size,
                      moe_intermediate_size=m.expert_intermediate_size, num_experts=m.num_experts,
                      shared_expert_intermediate_size=m.shared_expert_intermediate_size,
                      norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=False,
                      use_sliding_window=False)
    return config


def config_from_hf(hf: dict, where: str) -> dict:
    """mindlab MoE config fields for a Mixtral or Qwen2-MoE config.json (`where` names it in errors)."""
    arch = hf["architectures"][0]
    if hf.get("rope_scaling"):
        raise UserError(f"{where}: rope_scaling {hf['rope_scaling']}: the moe family imports unscaled RoPE only")
    model = {"family": "moe", "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
             "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
             "num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
             "max_position_embeddings": hf["max_position_embeddings"], "norm_eps": hf["rms_norm_eps"],
             "rope_theta": hf.get("rope_theta", 10000.0), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
             "top_k": hf["num_experts_per_tok"], "aux_loss_coef": hf.get("router_aux_loss_coef", 0.001)}
    if arch == "MixtralForCausalLM":
        model.update(num_experts=hf["num_local_experts"], expert_intermediate_size=hf["intermediate_size"],
                     norm_topk_prob=True)
    else:
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise UserError(f"{where}: decoder_sparse_step / mlp_only_layers (dense layers between MoE layers) are "
                            "not supported: every layer of the moe family routes")
        model.update(num_experts=hf["num_experts"], expert_intermediate_size=hf["moe_intermediate_size"],
                     shared_expert_intermediate_size=hf["shared_expert_intermediate_size"], shared_expert_gate=True,
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return model


def save_generation_config(m, out_dir: str) -> None:
    """generation_config.json: the special tokens generation stops at and pads with, and the context length."""
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     max_length=m.max_position_embeddings).save_pretrained(out_dir)
