"""The export of a decoder built of models/common/ blocks to MindFormers 1.9's `LlamaForCausalLM` files: its
weights (the same parameter names as MindFormers', or renamed by the family) as a `.ckpt`, and the model part of a
MindFormers run YAML (`model.model_config`, a `LlamaConfig`, plus what the family adds: a MoE's `moe_config`)."""
import os
from typing import Optional

import mindspore as ms
from omegaconf import OmegaConf

from models.common.hf import BOS_ID, EOS_ID, PAD_ID

EXTEND_METHOD = {"none": "None", "linear": "PI", "ntk": "NTK"}  # model.rope_scaling.type -> MindFormers'


def llama_config(cfg, intermediate_size: int) -> dict:
    """MindFormers' LlamaConfig keys of a run's config: the decoder's shape, RoPE, the special tokens, dtypes."""
    m = cfg.model
    seq_length = OmegaConf.select(cfg, "data.seq_len", default=m.max_position_embeddings)
    return {"type": "LlamaConfig", "seq_length": seq_length, "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "num_layers": m.num_layers,
            "num_heads": m.num_heads, "n_kv_heads": m.num_kv_heads, "intermediate_size": intermediate_size,
            "max_position_embedding": m.max_position_embeddings, "rms_norm_eps": m.norm_eps, "theta": m.rope_theta,
            "extend_method": EXTEND_METHOD[m.rope_scaling.type], "scaling_factor": m.rope_scaling.factor,
            "tie_word_embeddings": m.tie_embeddings, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID, "compute_dtype": "float16", "param_init_type": "float32",
            "layernorm_compute_type": "float32", "softmax_compute_type": "float32", "rotary_dtype": "float32"}


def write(weights: dict, out_dir: str, location: Optional[str], model_config: dict, **top_level) -> None:
    """`llama.ckpt` (these names and arrays) and `llama_mindlab.yaml`, whose load_checkpoint is the .ckpt's absolute
    path once out_dir is at `location` (the CLI writes into a temporary directory first); `top_level`: more keys
    of the run YAML (a MoE's moe_config)."""
    os.makedirs(out_dir, exist_ok=True)
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in weights.items()],
                       os.path.join(out_dir, "llama.ckpt"))
    yaml = {"load_checkpoint": os.path.abspath(os.path.join(location or out_dir, "llama.ckpt")), **top_level,
            "model": {"arch": {"type": "LlamaForCausalLM"}, "model_config": model_config}}
    OmegaConf.save(OmegaConf.create(yaml), os.path.join(out_dir, "llama_mindlab.yaml"))
