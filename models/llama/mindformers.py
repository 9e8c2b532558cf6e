"""MindFormers 1.9's own `LlamaForCausalLM`, built from the same config as the native model, and the export
of a mindlab checkpoint to MindFormers' files.

Wrapped so that it has the native model's interface (tokens [B, S] -> fp32 logits) and trains under the
same objective, optimizer and loop: `model.impl=mindformers` swaps only the network. The flags below are
the ones under which MindFormers' Llama trains on CPU: no fused RMSNorm kernel, the sliced RoPE path,
plain attention (there is no CPU flash-attention kernel), and lazy-inline disabled.
"""
from typing import Optional

import mindspore as ms

from models.common.causal_lm import CausalLM
from models.common.mindformers import EXTEND_METHOD, llama_config, write
from models.llama.config import LlamaConfig

_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class MindFormersLlama(CausalLM):
    """Inputs must be exactly `seq_len` tokens long: MindFormers builds its causal mask for that length. A CausalLM
    (models/common/causal_lm.py) for the pretraining objective: no auxiliary loss, its own head (the fine-tuning
    objectives take the native model only)."""

    def __init__(self, cfg: LlamaConfig, seq_len: int, compute_dtype: str = "fp32", use_flash: bool = False,
                 seed: int = 0):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        from mindformers.models.llama import LlamaConfig as MFLlamaConfig, LlamaForCausalLM  # heavy: only when chosen

        ms.set_seed(seed)  # MindFormers initialises its weights from MindSpore's global RNG
        mf_cfg = MFLlamaConfig(
            batch_size=1, seq_length=seq_len, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers, num_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads,
            intermediate_size=cfg.intermediate_size, max_position_embedding=cfg.max_position_embeddings,
            rms_norm_eps=cfg.norm_eps, theta=cfg.rope_theta, extend_method=EXTEND_METHOD[cfg.rope_scaling.type],
            scaling_factor=cfg.rope_scaling.factor, tie_word_embeddings=cfg.tie_embeddings,
            init_method_std=cfg.init_std, compute_dtype=_DTYPE_NAMES[compute_dtype], param_init_type="float32",
            layernorm_compute_type="float32", softmax_compute_type="float32", rotary_dtype="float32",
            use_flash_attention=use_flash, fused_rms_norm=False, use_rope_slice=True,
            disable_lazy_inline=True)
        self.net = LlamaForCausalLM(mf_cfg)
        self.hidden_size = cfg.hidden_size

    def layers(self):
        return self.net.model.layers

    def construct(self, tokens):
        return self.head(self.net.model(tokens))

    def head(self, h):
        return self.net.lm_head(h).astype(ms.float32)


def export_checkpoint(cfg, weights: dict, out_dir: str, location: Optional[str] = None) -> None:
    """`llama.ckpt` (same parameter names) and `llama_mindlab.yaml`, the model part of a MindFormers run YAML
    (models/common/mindformers.py)."""
    write(weights, out_dir, location, llama_config(cfg, cfg.model.intermediate_size))
