"""The Llama family's Hugging Face adapter: parameter names, config.json, and the tokenizer files.

mindlab's Llama names are MindFormers' Llama names (so the MindFormers export renames nothing). Hugging Face's
differ only by the table below; shapes are equal ([out, in] linear weights) and both use the "rotate half"
RoPE pairing, so no weight is permuted. NTK-scaled RoPE (a raised base) is exported as the raised
`rope_theta` itself, which is the same function.
"""
import re
from typing import Dict

import numpy as np

from conf.errors import UserError

ARCHITECTURES = ("LlamaForCausalLM",)  # config.json architectures this adapter imports
HF_NAMES = {  # mindlab / MindFormers -> Hugging Face; {i} is the layer index
    "model.tok_embeddings.embedding_weight": "model.embed_tokens.weight",
    "model.layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "model.layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "model.layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "model.layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "model.layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "model.layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "model.norm_out.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# special token ids of data/tokenizer.py's sentencepiece models
PAD_ID, BOS_ID, EOS_ID = 0, 2, 3  # unk is 1


def _rename(name: str, table: Dict[str, str]) -> str:
    for source, target in table.items():
        match = re.fullmatch(re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)"), name)
        if match:
            return target.format(**match.groupdict())
    raise ValueError(f"no conversion rule for parameter {name!r}")


def to_hf(weights: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    return {_rename(k, HF_NAMES): v for k, v in weights.items()}


def from_hf(weights: Dict[str, np.ndarray], hf: dict) -> Dict[str, np.ndarray]:
    """A tied Hugging Face model may still store lm_head.weight (a copy of the embedding): dropped."""
    tied = bool(hf.get("tie_word_embeddings", False))
    back = {hf_name: ml for ml, hf_name in HF_NAMES.items()}
    return {_rename(k, back): v for k, v in weights.items() if not (tied and k == "lm_head.weight")}


def hf_config(m) -> dict:
    """Hugging Face LlamaConfig fields for a mindlab Llama config."""
    head_dim = m.hidden_size // m.num_heads
    theta, scaling = m.rope_theta, None
    if m.rope_scaling.type == "ntk":
        theta = theta * m.rope_scaling.factor ** (head_dim / (head_dim - 2))
    elif m.rope_scaling.type == "linear":
        scaling = {"rope_type": "linear", "factor": m.rope_scaling.factor}
    return dict(architectures=list(ARCHITECTURES), model_type="llama", vocab_size=m.vocab_size,
                hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_eps, rope_theta=theta,
                rope_scaling=scaling, tie_word_embeddings=m.tie_embeddings, hidden_act="silu",
                attention_bias=False, mlp_bias=False, torch_dtype="float32", pad_token_id=PAD_ID,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def config_from_hf(hf: dict, where: str) -> dict:
    """mindlab Llama config fields for a Hugging Face config.json (`where` names it in errors)."""
    model = {"family": "llama", "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
             "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
             "num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
             "intermediate_size": hf["intermediate_size"], "max_position_embeddings": hf["max_position_embeddings"],
             "norm_eps": hf["rms_norm_eps"], "rope_theta": hf.get("rope_theta", 10000.0),
             "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        model["rope_scaling"] = {"type": "linear", "factor": scaling["factor"]}
    elif scaling:
        raise UserError(f"{where}: rope_scaling {scaling} has no mindlab equivalent; mindlab imports linear scaling only")
    return model


def save_tokenizer(tokenizer_file: str, out_dir: str) -> None:
    """The sentencepiece model as a Hugging Face LlamaTokenizer (tokenizer.model + its config files)."""
    from transformers import LlamaTokenizer

    LlamaTokenizer(vocab_file=tokenizer_file, add_bos_token=False, add_eos_token=False, legacy=False,
                   pad_token="<pad>").save_pretrained(out_dir)
