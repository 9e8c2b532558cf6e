"""Parameter and FLOP accounting for BERT (models/bert/model.py), from the config alone (no weights built).

`m` is anything with BertConfig's shape fields (the OmegaConf node, the dataclass, a namespace).
Every linear has a bias; every LayerNorm has a weight and a bias (2h).
"""
from typing import Any, Dict, List, Tuple


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def parameter_count(m: Any) -> Dict[str, int]:
    """Trainable parameters by component (what `model.trainable_params()` holds).

    embeddings: word V*h + position P*h + token type T*h + LayerNorm 2h.
    per_layer:  q, k, v, o (h x h + h each) + LayerNorm 2h + intermediate h*f + f + output f*h + h + LayerNorm 2h.
    pooler:     dense h*h + h.
    mlm_head:   transform dense h*h + h + LayerNorm 2h + decoder bias V (the decoder weight is the word
                embedding, counted once under embeddings).
    nsp_head:   dense h*2 + 2.
    BERT-base (V 30522, h 768, L 12, f 3072, P 512, T 2) gives total 110,106,428, as Hugging Face's
    BertForPreTraining (whose `parameters()` yields the tied weight once).
    """
    h, f, vocab = m.hidden_size, m.intermediate_size, m.vocab_size
    per_layer = 4 * _linear(h, h) + 2 * h + _linear(h, f) + _linear(f, h) + 2 * h
    counts = {
        "embeddings": (vocab + m.max_position_embeddings + m.type_vocab_size) * h + 2 * h,
        "per_layer": per_layer,
        "layers": m.num_layers * per_layer,
        "pooler": _linear(h, h),
        "mlm_head": _linear(h, h) + 2 * h + vocab,
        "nsp_head": _linear(h, 2),
    }
    counts["total"] = (counts["embeddings"] + counts["layers"] + counts["pooler"] + counts["mlm_head"]
                       + counts["nsp_head"])
    return counts


def matmul_parameter_count(m: Any) -> int:
    """Matmul weights applied to every token: the per-token N of 6N.

    Included: q/k/v/o and the two MLP matrices of every layer (L * (4h^2 + 2hf)), the MLM transform dense
    (h^2) and the tied decoder (V*h: the model computes MLM logits at every position, and a tied decoder
    still costs a V x h matmul). Excluded: the pooler (h^2) and the NSP head (2h), which run once per
    sequence on [CLS], not per token (negligible: h^2 / seq_len per token); the embedding lookups, LayerNorms
    and biases, which are not matmuls.
    """
    h = m.hidden_size
    return m.num_layers * (4 * h * h + 2 * h * m.intermediate_size) + h * h + m.vocab_size * h


def flops_per_token(m: Any, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM (Chowdhery et al. 2022) appendix B:

        6 * N_matmul + 12 * L * h * seq_len

    6 * N_matmul: a multiply-add (2 FLOPs) per matmul weight per token in the forward pass, twice that in
    the backward (gradients w.r.t. inputs and weights); N_matmul is matmul_parameter_count.
    12 * L * h * seq_len: the QK^T and probs @ V matmuls (2 * 2 * seq_len * h per token per layer forward,
    x3 for training). BERT attention is bidirectional, so there is no causal discount to argue about: every
    query really attends to all seq_len keys (padded keys are masked, not skipped). Elementwise work
    (softmax, GELU, LayerNorms) is ignored.
    """
    return float(6 * matmul_parameter_count(m) + 12 * m.num_layers * m.hidden_size * seq_len)


def stage_parameters(m: Any, p: Any) -> List[int]:
    """Parameters on one device (planner/memory.py): all of them; the family has no tp/pp plan (validation
    refuses tp/pp > 1 for it), so a device holds the whole model."""
    return [parameter_count(m)["total"]]


def layer_activation_factors(m: Any) -> Tuple[float, float]:
    """(replicated, tp-sharded) activations an encoder layer keeps for its backward, in units of s*b*h elements,
    without the softmax output (planner/memory.py adds it) and without dropout masks: 4 replicated (the
    attention input, both LayerNorm inputs, the MLP input); Q, K, V, the attention output and the GELU's
    input and output (2*f/h)."""
    return 4.0, 4 + 2 * m.intermediate_size / m.hidden_size
