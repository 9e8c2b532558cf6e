"""Config rules the decoder families share (pure Python: the config validation calls them before anything is
built)."""
from base.errors import require


def check_attention_shape(m) -> None:
    """GQA attention with RoPE: heads divide the width, an even head dim, kv heads divide the heads."""
    require(m.hidden_size % m.num_heads == 0, "model.num_heads",
            f"hidden_size={m.hidden_size} is not divisible by num_heads={m.num_heads}")
    require((m.hidden_size // m.num_heads) % 2 == 0, "model.num_heads",
            f"head_dim={m.hidden_size // m.num_heads} must be even for RoPE")
    require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
            f"num_heads={m.num_heads} is not a multiple of num_kv_heads={m.num_kv_heads}")
