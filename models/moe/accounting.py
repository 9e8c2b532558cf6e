"""Parameter and FLOP accounting of the mixture-of-experts decoder, from the config alone.

Two counts differ here: `parameter_count` is every weight held (all experts: the memory), and
`matmul_parameter_count` the matmul weights ONE token runs through (top_k routed experts, the shared expert, the
router, attention, the head): the active parameters, the 6N of the training FLOPs (Mixtral 8x7B: 46.7B total,
12.9B active).
"""
from typing import Any, Dict, List, Tuple

from models.common.accounting import _attention_weights, _head_dim, stage_parameters_of


def _expert_weights(m: Any) -> int:
    """One routed expert's SwiGLU: w1, w3 [f, h] and w2 [h, f]."""
    return 3 * m.hidden_size * m.expert_intermediate_size


def _shared_weights(m: Any) -> int:
    """The shared expert's SwiGLU and, with it gated, its [1, h] gate."""
    shared = 3 * m.hidden_size * m.shared_expert_intermediate_size
    return shared + (m.hidden_size if shared and m.shared_expert_gate else 0)


def linear_shapes(m: Any) -> Dict[str, Tuple[int, int]]:
    """(in, out) of every linear cell by path (what LoRA's target_modules match): attention, the router, the
    shared expert, the head. The routed experts are stacked Parameters, not linear cells: LoRA does not adapt them."""
    h, kv_dim, fs = m.hidden_size, m.num_kv_heads * _head_dim(m), m.shared_expert_intermediate_size
    layer = {"attention.wq": (h, h), "attention.wk": (h, kv_dim), "attention.wv": (h, kv_dim),
             "attention.wo": (h, h), "feed_forward.router": (h, m.num_experts)}
    if fs:
        layer.update({"feed_forward.shared_expert.w1": (h, fs), "feed_forward.shared_expert.w3": (h, fs),
                      "feed_forward.shared_expert.w2": (fs, h)})
        if m.shared_expert_gate:
            layer["feed_forward.shared_expert_gate"] = (h, 1)
    shapes = {f"model.layers.{i}.{name}": shape for i in range(m.num_layers) for name, shape in layer.items()}
    if not m.tie_embeddings:
        shapes["lm_head"] = (h, m.vocab_size)
    return shapes


def parameter_count(m: Any) -> Dict[str, int]:
    """Parameters by component (every expert counted): per_layer = 2 norms + attention + router E*h + E experts
    + the shared expert; `active_per_layer` the same with top_k experts. Mixtral 8x7B gives total 46,702,792,704."""
    h, vocab = m.hidden_size, m.vocab_size
    common = 2 * h + _attention_weights(m) + m.num_experts * h + _shared_weights(m)
    per_layer = common + m.num_experts * _expert_weights(m)
    counts = {
        "embedding": vocab * h,
        "per_layer": per_layer,
        "experts_per_layer": m.num_experts * _expert_weights(m),
        "active_per_layer": common + m.top_k * _expert_weights(m),
        "layers": m.num_layers * per_layer,
        "final_norm": h,
        "lm_head": 0 if m.tie_embeddings else vocab * h,
    }
    counts["total"] = counts["embedding"] + counts["layers"] + counts["final_norm"] + counts["lm_head"]
    counts["active"] = (counts["embedding"] + m.num_layers * counts["active_per_layer"] + counts["final_norm"]
                        + counts["lm_head"])
    return counts


def matmul_parameter_count(m: Any) -> int:
    """The matmul weights one token runs through (ACTIVE): attention, the router, top_k experts, the shared
    expert, and the head (tied or not, a V x h matmul)."""
    layer = _attention_weights(m) + m.num_experts * m.hidden_size + m.top_k * _expert_weights(m) + _shared_weights(m)
    return m.num_layers * layer + m.vocab_size * m.hidden_size


def flops_per_token(m: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the active matmul weights + 12 L heads head_dim seq_len (PaLM appendix B,
    as the Llama family's). Routing, softmax and the dispatch gathers are not counted."""
    return float(6 * matmul_parameter_count(m) + 12 * m.num_layers * m.num_heads * _head_dim(m) * seq_len)


def stage_parameters(m: Any, p: Any) -> List[int]:
    """Parameters one device of each pipeline stage holds: the stage's layers with every matmul weight split over
    tp and the routed experts over ep x tp (MindFormers' expert weights: (ep, 1, mp)); norms replicated; the
    embedding on the first stage, the head and final norm on the last."""
    counts, norms = parameter_count(m), 2 * m.hidden_size
    experts = counts["experts_per_layer"]
    layer = (counts["per_layer"] - norms - experts) // p.tp + experts // (p.ep * p.tp) + norms
    return stage_parameters_of(m, p, counts, layer)


def layer_activation_factors(m: Any) -> Tuple[float, float]:
    """(replicated, tp-sharded) activations per layer in units of s*b*h, without the softmax output: Llama's
    attention terms, and for the feed-forward the router logits (E/h), the top_k gathered copies of each token
    in and out (2k) with their SwiGLU intermediates (4 k f/h), and the shared expert's 4 f_s/h."""
    attention = 2 + 2 * m.num_kv_heads / m.num_heads
    ffn = (m.num_experts / m.hidden_size + 2 * m.top_k + 4 * m.top_k * m.expert_intermediate_size / m.hidden_size
           + 4 * m.shared_expert_intermediate_size / m.hidden_size)
    return 4.0, attention + ffn
