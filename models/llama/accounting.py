"""Parameter and FLOP accounting for the Llama-style decoder, from the config alone (no weights built).

Used by the dry run (planner/dry_run.py), the memory plan (planner/memory.py) and MFU.
`m` is anything with LlamaConfig's shape fields (the OmegaConf node, the dataclass, a namespace).
"""
from typing import Any, Dict, List, Tuple

from models.common.accounting import _attention_weights, _head_dim, stage_parameters_of


def _ffn_weights(m: Any) -> int:
    """SwiGLU: w1 (gate) and w3 (up) are h x ffn, w2 (down) is ffn x h."""
    return 3 * m.hidden_size * m.intermediate_size


def linear_shapes(m: Any) -> Dict[str, Tuple[int, int]]:
    """(in, out) features of every linear cell, by its path in the model (what LoRA's target_modules match)."""
    h, kv_dim, f = m.hidden_size, m.num_kv_heads * _head_dim(m), m.intermediate_size
    layer = {"attention.wq": (h, h), "attention.wk": (h, kv_dim), "attention.wv": (h, kv_dim),
             "attention.wo": (h, h), "feed_forward.w1": (h, f), "feed_forward.w3": (h, f), "feed_forward.w2": (f, h)}
    shapes = {f"model.layers.{i}.{name}": shape for i in range(m.num_layers) for name, shape in layer.items()}
    if not m.tie_embeddings:
        shapes["lm_head"] = (h, m.vocab_size)
    return shapes


def parameter_count(m: Any) -> Dict[str, int]:
    """Parameters of the decoder by component; Llama has no biases.

    per_layer = attention_norm h + attention (wq, wk, wv, wo) + ffn_norm h + SwiGLU 3*h*ffn.
    lm_head is 0 when tied to the embedding. Llama-2 7B gives total 6,738,415,616.
    """
    h, vocab = m.hidden_size, m.vocab_size
    per_layer = h + _attention_weights(m) + h + _ffn_weights(m)
    counts = {
        "embedding": vocab * h,
        "per_layer": per_layer,
        "layers": m.num_layers * per_layer,
        "final_norm": h,
        "lm_head": 0 if m.tie_embeddings else vocab * h,
    }
    counts["total"] = counts["embedding"] + counts["layers"] + counts["final_norm"] + counts["lm_head"]
    return counts


def matmul_parameter_count(m: Any) -> int:
    """Parameters used as matmul weights: every linear of every layer plus the lm head.

    The embedding lookup and the norms are excluded; a tied head still costs a V x h matmul, so it is
    counted here whether or not it shares storage with the embedding.
    """
    return m.num_layers * (_attention_weights(m) + _ffn_weights(m)) + m.vocab_size * m.hidden_size


def flops_per_token(m: Any, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM (Chowdhery et al. 2022) appendix B:

        6 * N_matmul + 12 * L * heads * head_dim * seq_len

    6 * N_matmul: a multiply-add (2 FLOPs) per matmul weight per token in the forward pass, twice that in
    the backward (gradients w.r.t. inputs and weights). N_matmul is matmul_parameter_count: the SwiGLU
    counts as its three matrices, the lm head is included, the embedding lookup and norms are not.
    12 * L * heads * head_dim * seq_len: the QK^T and attention-times-V matmuls (2 * 2 * seq_len *
    heads * head_dim per token in the forward pass, x3 for training), with no discount for the causal
    mask. Elementwise work (softmax, RoPE, SiLU, norms) is ignored.
    """
    attention = 12 * m.num_layers * m.num_heads * _head_dim(m) * seq_len
    return float(6 * matmul_parameter_count(m) + attention)


def stage_parameters(m: Any, p: Any) -> List[int]:
    """Parameters held by one device of each pipeline stage (planner/memory.py): the stage's layers with every
    matmul weight split over tp (norms replicated), the vocab-parallel embedding on the first stage, the head
    (a second copy of a tied one when pp > 1) and the final norm on the last."""
    counts, norms = parameter_count(m), 2 * m.hidden_size
    return stage_parameters_of(m, p, counts, (counts["per_layer"] - norms) // p.tp + norms)


def layer_activation_factors(m: Any) -> Tuple[float, float]:
    """(replicated, tp-sharded) activations a decoder layer keeps for its backward, in units of s*b*h elements,
    without the softmax output (planner/memory.py adds it): 4 replicated (both norm inputs, the attention and
    MLP inputs); sharded Q, K, V (narrower under GQA), the attention output and SwiGLU's 4*f/h."""
    return 4.0, 2 + 2 * m.num_kv_heads / m.num_heads + 4 * m.intermediate_size / m.hidden_size
