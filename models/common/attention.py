"""Causal self-attention as decoder families share it, moved out of the Llama model unchanged: RoPE (the "rotate
half" pairs (i, i + d/2) of Hugging Face and MindFormers; tables from models/common/rope.py), GQA, the plain core
(CoreAttention: whole or in blocks of query rows), Ascend's flash attention (FlashCoreAttention) and the cached
inference path (Attention.cached: a static-shape KV cache per layer). `cfg` is any config with the decoder's
fields (hidden_size, num_heads, num_kv_heads, init_std, attention_chunk, rope_theta, rope_scaling,
max_position_embeddings).
"""
import math

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from models.common import rope
from models.common.layers import Linear

def rope_tables(cfg, length=None):
    """cos/sin tables [window, head_dim] fp32 for the config's RoPE and long-context scaling (rope.py has the
    methods): window = max_position_embeddings x factor when scaled; `length` is dynamic NTK's current length."""
    return rope.tables(cfg.hidden_size // cfg.num_heads, rope.window(cfg), cfg.rope_theta, cfg.rope_scaling,
                       cfg.max_position_embeddings, length)


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def apply_rope(x, cos, sin):
    """x [B, heads, S, D] rotated by the tables cos/sin [S, D] (or [B, 1, S, D]), in x's dtype."""
    return (x * cos + rotate_half(x) * sin).astype(x.dtype)


class Rotary(nn.Cell):
    """RoPE on q or k (apply_rope), a cell of its own so that a converter can replace it."""

    def construct(self, x, cos, sin):
        return apply_rope(x, cos, sin)


class AttentionBlock(nn.Cell):
    """softmax(q k^T / sqrt(d) + bias) v for a block of query rows against their keys; scores, softmax and
    probabilities live only inside it, so recomputing it (model.recompute=selective) frees them."""

    def __init__(self, head_dim: int, compute_dtype):
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.compute_dtype = compute_dtype
        self.qk = ops.BatchMatMul(transpose_b=True)
        self.pv = ops.BatchMatMul()
        self.softmax = ops.Softmax(-1)

    def construct(self, q, k, v, bias):
        scores = self.qk(q * self.scale, k).astype(ms.float32)  # scaling q: [S, D] per head, not the [S, S] scores
        probs = self.softmax(scores + bias).astype(self.compute_dtype)
        return self.pv(probs, v)


class CoreAttention(nn.Cell):
    """softmax(q k^T / sqrt(d) + mask) v on q [B, heads, S, D] and k, v [B, kv heads, S, D]; the part selective
    recompute redoes. GQA: each kv head is repeated for its `groups` = heads / kv heads query heads. The mask is
    causal, or, with `mask` given (packed samples), that additive [B, 1, S, S] bias.

    `chunk` > 0 (model.attention_chunk): query rows in blocks of `chunk`, block i against keys 0..end of the
    block only (the causal future is skipped: about half the FLOPs). Each row's softmax sees the same unmasked
    scores as in one block (masked ones are exp(-1e9) = 0 either way), so outputs and gradients are equal up to
    float summation order. With model.recompute=selective each block is recomputed in the backward, so only
    one block's [B, heads, chunk, S] scores are alive at a time instead of [B, heads, S, S] per layer."""

    def __init__(self, head_dim: int, compute_dtype, chunk: int = 0, groups: int = 1):
        super().__init__()
        self.block = AttentionBlock(head_dim, compute_dtype)
        self.chunk, self.groups = chunk, groups

    def construct(self, q, k, v, mask=None):
        if self.groups > 1:
            k, v = ops.repeat_interleave(k, self.groups, 1), ops.repeat_interleave(v, self.groups, 1)
        seq = q.shape[2]
        if not self.chunk or seq <= self.chunk:
            return self.block(q, k, v, self.causal_bias(0, seq) if mask is None else mask)
        outs = []
        for start in range(0, seq, self.chunk):
            stop = min(start + self.chunk, seq)
            bias = self.causal_bias(start, stop) if mask is None else mask[:, :, start:stop, :stop]
            outs.append(self.block(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], bias))
        return ops.cat(outs, 2)

    def causal_bias(self, start: int, stop: int):
        """[stop - start, stop]: -1e9 where key j > query i (rows start..stop-1), else 0. Built in the graph
        (a compare of two aranges per layer and step): a [max_positions, max_positions] constant per layer
        held 8 x 16 MiB at model=small."""
        rows = ops.arange(start, stop, dtype=ms.int32).reshape(-1, 1)
        cols = ops.arange(0, stop, dtype=ms.int32).reshape(1, -1)
        return (cols > rows).astype(ms.float32) * -1e9


class FlashCoreAttention(nn.Cell):
    """The same computation through Ascend's FlashAttentionScore (no CPU or GPU kernel; fp16/bf16 inputs only:
    validation refuses fp32). q [B, heads, S, D], k and v [B, kv heads, S, D]: the kernel reads each query head's kv
    head itself (GQA without repeats). Primitives, not ops.flash_attention_score, so that the tensor-parallel plan can
    shard them (plan.py: heads over tp, the batch over dp, as MindFormers' FlashAttention.shard).

    `causal` (no mask): sparse_mode=2 with the 2048 x 2048 upper-triangular mask, the documented compressed causal
    setting. `masked` (packed samples): sparse_mode=0 with the full [B, 1, S, S] mask, 1 where the additive bias
    hides a key."""

    def __init__(self, head_dim: int, num_heads: int):
        super().__init__()
        scale = 1.0 / math.sqrt(head_dim)
        self.causal = FlashAttentionScore(num_heads, scale_value=scale, input_layout="BNSD", sparse_mode=2)
        self.masked = FlashAttentionScore(num_heads, scale_value=scale, input_layout="BNSD", sparse_mode=0)
        self.causal_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), k=1))

    def construct(self, q, k, v, mask=None):
        if mask is None:
            return self.causal(q, k, v, None, None, None, self.causal_mask)[3]
        return self.masked(q, k, v, None, None, None, (mask < 0).astype(ms.uint8))[3]


class Attention(nn.Cell):
    """Causal self-attention with RoPE and GQA: CoreAttention on [B, heads, S, D], or `flash` (Ascend's
    FlashAttentionScore)."""

    def __init__(self, cfg, rng, compute_dtype, flash: bool = False):
        super().__init__()
        h, self.n_heads, self.n_kv = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        self.head_dim = h // self.n_heads
        std = cfg.init_std
        self.wq = Linear(h, self.n_heads * self.head_dim, std, rng, compute_dtype)
        self.wk = Linear(h, self.n_kv * self.head_dim, std, rng, compute_dtype)
        self.wv = Linear(h, self.n_kv * self.head_dim, std, rng, compute_dtype)
        self.wo = Linear(self.n_heads * self.head_dim, h, std, rng, compute_dtype)
        self.core = (FlashCoreAttention(self.head_dim, self.n_heads) if flash else
                     CoreAttention(self.head_dim, compute_dtype, cfg.attention_chunk, self.n_heads // self.n_kv))
        self.rope = Rotary()
        self.compute_dtype = compute_dtype
        self.qk_cached, self.pv_cached = ops.BatchMatMul(transpose_b=True), ops.BatchMatMul()  # inference only

    def heads(self, x):
        """q [B, S, heads, D], k and v [B, S, kv heads, D]: the projections in their own layout, before RoPE."""
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).reshape(b, s, self.n_kv, self.head_dim)
        v = self.wv(x).reshape(b, s, self.n_kv, self.head_dim)
        return q, k, v

    def project(self, x, cos, sin):
        """q [B, heads, S, D], k and v [B, kv heads, S, D], RoPE applied to q and k."""
        q, k, v = self.heads(x)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return self.rope(q, cos, sin), self.rope(k, cos, sin), v

    def construct(self, x, cos, sin, mask=None):
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)  # (GQA: the core pairs each kv head with its n_heads / n_kv queries)
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, s, -1))

    def cached(self, x, cos, sin, bias, k_cache=None, v_cache=None, slot=None):
        """Inference attention over x [B, S, hidden] -> [B, S, hidden].

        k_cache / v_cache [B, n_kv, L, head_dim] are this layer's keys and values (kv heads only): Parameters
        (models/common/generation.py holds them), written in place.
        - prefill (caches given, slot None): the S columns attend to each other under `bias` [B, 1, S, S];
          their k/v become cache columns 0..S-1, the rest is zeroed.
        - decode (S = 1, slot [1, 1, L, 1] bool, true at the column written): the token's k/v are written to
          that column and its query attends to the whole cache under `bias` [B, 1, 1, L].
        - no cache (caches None): like prefill, nothing kept (the uncached baseline).
        `bias` is 0 where attention is allowed and -1e9 elsewhere (padding, future, unwritten columns).
        GQA without repeating K/V: the g = n_heads / n_kv query heads of kv head j (j*g .. j*g+g-1, the order
        of `repeat_interleave` in `construct`) are stacked as g*S query rows against that head's keys."""
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        keys, values = k, v
        if slot is not None:  # decode: one new column, attend to the whole cache
            ops.assign(k_cache, ops.where(slot, k, k_cache))
            ops.assign(v_cache, ops.where(slot, v, v_cache))
            keys, values = k_cache, v_cache
        elif k_cache is not None:  # prefill: the prompt's own k/v, stored at columns 0..S-1
            rest = ops.zeros((b, self.n_kv, k_cache.shape[2] - s, self.head_dim), self.compute_dtype)
            ops.assign(k_cache, ops.cat((k, rest), 2))
            ops.assign(v_cache, ops.cat((v, rest), 2))
        g = self.n_heads // self.n_kv
        scores = self.qk_cached(q.reshape(b, self.n_kv, g * s, self.head_dim), keys).astype(ms.float32)
        scores = scores.reshape(b, self.n_kv, g, s, -1) * (1.0 / math.sqrt(self.head_dim)) + bias.expand_dims(1)
        probs = ops.softmax(scores, -1).astype(self.compute_dtype).reshape(b, self.n_kv, g * s, -1)
        out = self.pv_cached(probs, values).reshape(b, self.n_heads, s, self.head_dim)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, s, -1))
