"""Accounting the decoder families share (moved out of the Llama family's unchanged): the attention's weights."""
from typing import Any


def _head_dim(m: Any) -> int:
    return m.hidden_size // m.num_heads


def _attention_weights(m: Any) -> int:
    """wq and wo are h x h; wk and wv are h x (kv_heads * head_dim), smaller under grouped-query attention."""
    h, kv_dim = m.hidden_size, m.num_kv_heads * _head_dim(m)
    return 2 * h * h + 2 * h * kv_dim
