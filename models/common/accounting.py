"""Accounting the decoder families share (moved out of the Llama family's unchanged): the attention's weights."""
from typing import Any, Dict, List


def _head_dim(m: Any) -> int:
    return m.hidden_size // m.num_heads


def _attention_weights(m: Any) -> int:
    """wq and wo are h x h; wk and wv are h x (kv_heads * head_dim), smaller under grouped-query attention."""
    h, kv_dim = m.hidden_size, m.num_kv_heads * _head_dim(m)
    return 2 * h * h + 2 * h * kv_dim


def stage_parameters_of(m: Any, p: Any, counts: Dict[str, int], layer: int) -> List[int]:
    """Parameters held by one device of each pipeline stage (planner/memory.py), `layer` those of one decoder layer
    on one device: the stage's layers, the vocab-parallel embedding on the first stage, the head (a second copy of
    a tied one when pp > 1) and the final norm on the last."""
    params = [m.num_layers // p.pp * layer] * p.pp
    params[0] += counts["embedding"] // p.tp
    if not m.tie_embeddings or p.pp > 1:
        params[-1] += m.vocab_size * m.hidden_size // p.tp
    params[-1] += counts["final_norm"]
    return params
