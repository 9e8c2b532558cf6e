"""The Llama family: a decoder-only Transformer (RMSNorm, RoPE, GQA, SwiGLU), native or MindFormers' own.

    config.py      LlamaConfig, the typed `model` group      model.py        the native MindSpore model
    accounting.py  parameters and FLOPs from the config      mindformers.py  MindFormers' Llama + its export
    hf.py          Hugging Face names and config.json        plan.py         tensor/pipeline parallel plan

Importing this package is cheap (no MindSpore): the config schema and the dry run use it.
"""
from conf.errors import require
from models.llama import hf
from models.llama.accounting import flops_per_token, layer_activation_factors, matmul_parameter_count, \
    parameter_count, stage_parameters
from models.llama.config import LlamaConfig as Config

__all__ = ["Config", "build", "check", "describe", "flops_per_token", "hf", "layer_activation_factors",
           "matmul_parameter_count", "parameter_count", "stage_parameters"]
CAUSAL = True  # decoder-only: objectives that need bidirectional attention refuse it


def build(cfg: Config, seq_len: int, compute_dtype: str, use_flash: bool, seed: int):
    """The model cell: tokens [B, S] -> fp32 logits [B, S, vocab]."""
    if cfg.impl == "mindformers":
        from models.llama.mindformers import MindFormersLlama

        return MindFormersLlama(cfg, seq_len, compute_dtype, use_flash, seed)
    from models.llama.model import LlamaForCausalLM

    return LlamaForCausalLM(cfg, compute_dtype, use_flash, seed)


def recompute_cells(model, mode: str) -> list:
    """full: each decoder layer; selective: only the attention core (scores/softmax)."""
    return [layer if mode == "full" else layer.attention.core for layer in model.layers()]


def check(cfg) -> None:
    """Rules of this family's keys (conf/validate.py calls it; each failure names the key)."""
    m = cfg.model
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        require(m[key] > 0, f"model.{key}", f"must be positive, got {m[key]}")
    require(m.impl in ("native", "mindformers"), "model.impl", f"got {m.impl!r}; choose one of native, mindformers")
    require(m.rope_scaling.type in ("none", "linear", "ntk"), "model.rope_scaling.type",
            f"got {m.rope_scaling.type!r}; choose one of none, linear, ntk")
    require(m.hidden_size % m.num_heads == 0, "model.num_heads",
            f"hidden_size={m.hidden_size} is not divisible by num_heads={m.num_heads}")
    require((m.hidden_size // m.num_heads) % 2 == 0, "model.num_heads",
            f"head_dim={m.hidden_size // m.num_heads} must be even for RoPE")
    require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
            f"num_heads={m.num_heads} is not a multiple of num_kv_heads={m.num_kv_heads}")
    require(m.rope_scaling.factor >= 1.0, "model.rope_scaling.factor", f"must be >= 1, got {m.rope_scaling.factor}")
    p = cfg.parallel
    for key in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):
        require(m[key] % p.tp == 0, "parallel.tp", f"tp={p.tp} does not divide model.{key}={m[key]}")


def describe(m, count) -> list:
    """Dry-run lines: the shape and where the parameters are (`count` formats a number)."""
    c = parameter_count(m)
    return [f"  vocab {m.vocab_size}, hidden {m.hidden_size}, {m.num_layers} layers, {m.num_heads} heads "
            f"({m.num_kv_heads} kv, head dim {m.hidden_size // m.num_heads}), ffn {m.intermediate_size}",
            f"  embedding   {count(c['embedding'])}",
            f"  layers      {count(c['layers'])} = {m.num_layers} x {count(c['per_layer'])}",
            f"  final norm  {count(c['final_norm'])}",
            f"  lm head     {'tied to the embedding' if m.tie_embeddings else count(c['lm_head'])}"]
