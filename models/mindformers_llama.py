"""MindFormers 1.9's own `LlamaForCausalLM`, built from the same ModelConfig as the native model.

Wrapped so that it has the native model's interface (tokens [B, S] -> fp32 logits) and trains under the
same objective, optimizer and loop: `model.impl=mindformers` swaps only the network. The flags below are
the ones under which MindFormers' Llama trains on CPU: no fused RMSNorm kernel, the sliced RoPE path,
plain attention (there is no CPU flash-attention kernel), and lazy-inline disabled.
"""
import mindspore as ms
from mindspore import nn

from conf.schema import ModelConfig

_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _extend_method(cfg: ModelConfig) -> str:
    return {"none": "None", "linear": "PI", "ntk": "NTK"}[cfg.rope_scaling.type]


class MindFormersLlama(nn.Cell):
    """Inputs must be exactly `seq_len` tokens long: MindFormers builds its causal mask for that length."""

    def __init__(self, cfg: ModelConfig, seq_len: int, compute_dtype: str = "fp32", use_flash: bool = False,
                 seed: int = 0):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        from mindformers.models.llama import LlamaConfig, LlamaForCausalLM  # heavy import, only when chosen

        ms.set_seed(seed)  # MindFormers initialises its weights from MindSpore's global RNG
        mf_cfg = LlamaConfig(
            batch_size=1, seq_length=seq_len, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers, num_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads,
            intermediate_size=cfg.intermediate_size, max_position_embedding=cfg.max_position_embeddings,
            rms_norm_eps=cfg.norm_eps, theta=cfg.rope_theta, extend_method=_extend_method(cfg),
            scaling_factor=cfg.rope_scaling.factor, tie_word_embeddings=cfg.tie_embeddings,
            init_method_std=cfg.init_std, compute_dtype=_DTYPE_NAMES[compute_dtype], param_init_type="float32",
            layernorm_compute_type="float32", softmax_compute_type="float32", rotary_dtype="float32",
            use_flash_attention=use_flash, fused_rms_norm=False, use_rope_slice=True,
            disable_lazy_inline=True)
        self.net = LlamaForCausalLM(mf_cfg)

    def construct(self, tokens):
        hidden = self.net.model(tokens)
        return self.net.lm_head(hidden).astype(ms.float32)
