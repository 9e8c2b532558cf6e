"""Parameter and FLOP accounting for the Llama-style decoder, from the config alone (no weights built).

Used by the dry run (trainer/dry_run.py), the memory plan (distributed/memory.py) and MFU.
`m` is anything with ModelConfig's shape fields (the OmegaConf node, the dataclass, a namespace).
"""
from typing import Any, Dict


def _head_dim(m: Any) -> int:
    return m.hidden_size // m.num_heads


def _attention_weights(m: Any) -> int:
    """wq and wo are h x h; wk and wv are h x (kv_heads * head_dim), smaller under grouped-query attention."""
    h, kv_dim = m.hidden_size, m.num_kv_heads * _head_dim(m)
    return 2 * h * h + 2 * h * kv_dim


def _ffn_weights(m: Any) -> int:
    """SwiGLU: w1 (gate) and w3 (up) are h x ffn, w2 (down) is ffn x h."""
    return 3 * m.hidden_size * m.intermediate_size


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
