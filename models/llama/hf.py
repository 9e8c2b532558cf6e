"""The Llama family's Hugging Face adapter: parameter names, config.json, and the tokenizer files.

mindlab's Llama names are MindFormers' Llama names (so the MindFormers export renames nothing). Hugging Face's
differ only by the table below; shapes are equal ([out, in] linear weights) and both use the "rotate half"
RoPE pairing, so no weight is permuted. RoPE scaling maps to config.json's `rope_scaling` (linear, dynamic,
yarn, llama3: transformers builds equal tables); fixed NTK (a raised base) is exported as the raised
`rope_theta` itself, which is the same function.
"""
from typing import Dict

import numpy as np

from base.errors import UserError
from models.common import rope
from models.common.hf import BOS_ID, DECODER_NAMES, EOS_ID, PAD_ID, _rename, save_tokenizer  # noqa: F401

ARCHITECTURES = ("LlamaForCausalLM",)  # config.json architectures this adapter imports
HF_NAMES = {**DECODER_NAMES,  # mindlab / MindFormers -> Hugging Face; {i} is the layer index
            "model.layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
            "model.layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
            "model.layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight"}
# config.json of a reward model (objective=rm): transformers' sequence classifier with one label, which
# scores the last token that is not padding, as objectives/rm.py reads the eos closing the response
REWARD_MODEL = {"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}


def to_hf(weights: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    return {_rename(k, HF_NAMES): v for k, v in weights.items()}


def from_hf(weights: Dict[str, np.ndarray], hf: dict) -> Dict[str, np.ndarray]:
    """A tied Hugging Face model may still store lm_head.weight (a copy of the embedding): dropped."""
    tied = bool(hf.get("tie_word_embeddings", False))
    back = {hf_name: ml for ml, hf_name in HF_NAMES.items()}
    return {_rename(k, back): v for k, v in weights.items() if not (tied and k == "lm_head.weight")}


def rope_scaling_to_hf(m) -> tuple:
    """(rope_theta, rope_scaling, max_position_embeddings) of config.json for model.rope_scaling. The HF
    window is ours (max_position_embeddings x factor), with the pretrained length as
    `original_max_position_embeddings` where transformers reads one (yarn, llama3); dynamic NTK reads
    max_position_embeddings itself as the pretrained length."""
    s, original = m.rope_scaling, m.max_position_embeddings
    window = rope.window(m)
    if s.type == "none":
        return m.rope_theta, None, original
    if s.type == "ntk":
        return rope.ntk_theta(m), None, window
    if s.type == "dynamic":
        return m.rope_theta, {"rope_type": "dynamic", "factor": s.factor}, original
    scaling = {"rope_type": s.type, "factor": s.factor}
    if s.type == "yarn":
        scaling.update(original_max_position_embeddings=original, beta_fast=s.beta_fast, beta_slow=s.beta_slow,
                       truncate=s.truncate)
        scaling.update({k: s[k] for k in ("attention_factor", "mscale", "mscale_all_dim") if s[k] is not None})
    elif s.type == "llama3":
        scaling.update(original_max_position_embeddings=original, low_freq_factor=s.low_freq_factor,
                       high_freq_factor=s.high_freq_factor)
    return m.rope_theta, scaling, window


def rope_scaling_from_hf(hf: dict, where: str) -> tuple:
    """(model.rope_scaling fields or None, pretrained max_position_embeddings) for a config.json."""
    scaling = dict(hf.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    hf_max = hf["max_position_embeddings"]
    if kind == "default":
        return None, hf_max
    if kind not in ("linear", "dynamic", "yarn", "llama3"):
        raise UserError(f"{where}: rope_scaling {hf['rope_scaling']} has no mindlab equivalent; mindlab imports "
                        f"linear, dynamic, yarn and llama3 scaling")
    factor = float(scaling.pop("factor"))
    original = scaling.pop("original_max_position_embeddings", None)
    if kind == "linear":
        original = max(1, round(hf_max / factor))
    elif kind == "dynamic" or original is None:  # transformers reads max_position_embeddings as the original
        original = hf_max
    fields = {"type": kind, "factor": factor}
    fields.update({k: v for k, v in scaling.items() if v is not None})
    return fields, int(original)


def hf_config(m) -> dict:
    """Hugging Face LlamaConfig fields for a mindlab Llama config."""
    theta, scaling, max_positions = rope_scaling_to_hf(m)
    return dict(architectures=list(ARCHITECTURES), model_type="llama", vocab_size=m.vocab_size,
                hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                max_position_embeddings=max_positions, rms_norm_eps=m.norm_eps, rope_theta=theta,
                rope_scaling=scaling, tie_word_embeddings=m.tie_embeddings, hidden_act="silu",
                attention_bias=False, mlp_bias=False, torch_dtype="float32", pad_token_id=PAD_ID,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def config_from_hf(hf: dict, where: str) -> dict:
    """mindlab Llama config fields for a Hugging Face config.json (`where` names it in errors)."""
    scaling, original = rope_scaling_from_hf(hf, where)
    model = {"family": "llama", "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
             "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
             "num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
             "intermediate_size": hf["intermediate_size"], "max_position_embeddings": original,
             "norm_eps": hf["rms_norm_eps"], "rope_theta": hf.get("rope_theta", 10000.0),
             "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    if scaling:
        model["rope_scaling"] = scaling
    return model


def save_generation_config(m, out_dir: str) -> None:
    """generation_config.json: the special tokens generation stops at and pads with, and the context length."""
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     max_length=rope_scaling_to_hf(m)[2]).save_pretrained(out_dir)
