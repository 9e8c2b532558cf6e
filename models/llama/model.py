"""A Llama-style decoder-only Transformer as MindSpore cells, readable top to bottom.

token embedding -> N x [RMSNorm -> causal self-attention (RoPE, GQA) -> residual,
                        RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (optionally tied)

Parameter names and shapes are MindFormers' Llama names, which map 1:1 to Hugging Face
`LlamaForCausalLM` (MindFormers' `convert_name`): `model.tok_embeddings.embedding_weight` = `model.embed_tokens.weight`,
`attention.wq/wk/wv/wo` = `self_attn.q/k/v/o_proj`, `feed_forward.w1/w2/w3` = `mlp.gate/down/up_proj`,
`attention_norm`/`ffn_norm` = `input_layernorm`/`post_attention_layernorm`, `model.norm_out` = `model.norm`.
Linear weights are [out_features, in_features] as in both.

RoPE follows the Hugging Face / MindFormers convention ("rotate half"): the rotary pairs are (i, i + d/2),
not the interleaved (2i, 2i+1) pairs of Meta's original code.

Devices: the cells here use MindSpore's ops as written (broadcasting, reductions over the last axis, autodiff's
softmax gradient), which is what Ascend and GPU run. After the build, models/llama/device_ops.py's twins replace a
few of them where a device wants otherwise: on CPU the memory and speed workarounds MindSpore's CPU kernels need
(explicit broadcasts, 2-D reductions, a hand-written softmax backward), on Ascend its fused RMSNorm and RoPE.

Precision: parameters are fp32 (master weights). Matmuls run in `compute_dtype` (fp32/fp16/bf16);
RMSNorm statistics, softmax and the loss stay in fp32.

Attention: CoreAttention below on [B, heads, S, D] (the kv heads repeated for GQA), or Ascend's flash attention
(`model.flash_attention`: the FlashAttentionScore primitive, kv heads as they are). This file is plain MindSpore and
runs everywhere; converters replace some of its cells after the build without changing it: LoRA (adapters/lora.py),
the device twins above and, on CPU, the compiled kernels' twins (models/llama/kernels.py), each where the family's
build finds they apply (models/llama/__init__.py). The tensor/pipeline plan (plan.py) sets its strategies on the
primitives here.

Inference (`LlamaForCausalLM.generate`, models/llama/generation.py) goes through the `cached` methods: the same
weights and operations as `construct`, plus a static-shape KV cache per layer ([B, n_kv_heads, L, head_dim] for
K and V: the kv heads, not their GQA repeats; Parameters, written in place), an additive attention bias for
left-padded batches and per-row positions. `construct` (training) does not use them.
"""
import math
from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from models.llama import rope
from models.llama.config import LlamaConfig

DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}


def _init(rng: Optional[np.random.Generator], shape, std: float) -> Parameter:
    """N(0, std) weights: drawn now from `rng` (identical on every rank and backend), or with rng None (a sharded
    build) deferred to MindSpore's initializer, which the semi-auto compile runs on each rank's slice only, as
    MindFormers does: no rank materialises the whole model (a 70B model is 280 GB of fp32)."""
    if rng is None:
        return Parameter(initializer(Normal(std), shape, ms.float32))
    return Parameter(Tensor(rng.normal(0.0, std, size=shape).astype(np.float32)))


class Linear(nn.Cell):
    """y = x @ W^T with W [out, in] (no bias), computed in `compute_dtype`."""

    def __init__(self, in_features: int, out_features: int, std: float, rng, compute_dtype):
        super().__init__()
        self.weight = _init(rng, (out_features, in_features), std)
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).astype(self.compute_dtype)
        return self.matmul(x, self.weight.astype(self.compute_dtype)).reshape(shape[:-1] + (-1,))


class RMSNorm(nn.Cell):
    """x / rms(x) * weight in fp32, over x's last axis. Written with primitives so sequence parallelism can shard
    each of them (plan.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)))
        self.eps = eps
        self.square, self.mean, self.add, self.rsqrt = ops.Square(), ops.ReduceMean(keep_dims=True), ops.Add(), ops.Rsqrt()
        self.normalize, self.scale = ops.Mul(), ops.Mul()

    def construct(self, x):
        x32 = x.astype(ms.float32)
        inv_rms = self.rsqrt(self.add(self.mean(self.square(x32), -1), self.eps))
        return self.scale(self.normalize(x32, inv_rms), self.weight).astype(x.dtype)


def rope_tables(cfg: LlamaConfig, length=None):
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

    def __init__(self, cfg: LlamaConfig, rng, compute_dtype, flash: bool = False):
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
        (models/llama/generation.py holds them), written in place.
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


class FeedForward(nn.Cell):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig, rng, compute_dtype):
        super().__init__()
        h, f, std = cfg.hidden_size, cfg.intermediate_size, cfg.init_std
        self.w1 = Linear(h, f, std, rng, compute_dtype)
        self.w2 = Linear(f, h, std, rng, compute_dtype)
        self.w3 = Linear(h, f, std, rng, compute_dtype)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Cell):
    """Compiled once and reused for every layer: `lazy_inline` parses one layer's graph and inlines it N times
    ("front" policy; the default keeps it a called subgraph, which does not compile on CPU). At model=small the
    ForwardBackward graph compiles in 2.7 s instead of 4.8, the first optimizer step comes 2 s sooner, with the
    same losses and tokens/s (benchmarks/speed_memory.py). MindSpore marks the API Ascend-only; it is tested here on
    CPU against PyNative (tests/test_lora.py)."""

    @ms.lazy_inline(policy="front")
    def __init__(self, cfg: LlamaConfig, rng, compute_dtype, flash: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg, rng, compute_dtype, flash)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg, rng, compute_dtype)
        self.attention_residual, self.ffn_residual = ops.Add(), ops.Add()  # primitives: plan.py shards them

    @property
    def cell_init_args(self) -> str:
        """The key under which lazy_inline reuses a layer's graph. MindSpore's is the constructor's arguments, the
        same for every layer even after a converter changed some of them (LoRA on `re:model\\.layers\\.0\\..*`):
        they would share one graph. This key is the layer's structure: its cells' types and its parameters'
        shapes, dtypes and trainability."""
        cells = [f"{name}:{type(cell).__name__}" for name, cell in self.cells_and_names()]
        params = [f"{name}:{p.shape}:{p.dtype}:{p.requires_grad}" for name, p in self.parameters_and_names()]
        return f"lazy_inline_DecoderLayer{cells}{params}"

    @cell_init_args.setter
    def cell_init_args(self, value: str) -> None:
        """lazy_inline and Cell assign the argument-based key; the property above replaces it."""

    def construct(self, x, cos, sin, mask=None):
        x = self.attention_residual(x, self.attention(self.attention_norm(x), cos, sin, mask).astype(x.dtype))
        return self.ffn_residual(x, self.feed_forward(self.ffn_norm(x)).astype(x.dtype))

    def cached(self, x, cos, sin, bias, k_cache=None, v_cache=None, slot=None):
        x = x + self.attention.cached(self.attention_norm(x), cos, sin, bias, k_cache, v_cache, slot).astype(x.dtype)
        return x + self.feed_forward(self.ffn_norm(x)).astype(x.dtype)


class Embedding(nn.Cell):
    def __init__(self, vocab_size: int, dim: int, std: float, rng):
        super().__init__()
        self.embedding_weight = _init(rng, (vocab_size, dim), std)
        self.gather = ops.Gather()

    def construct(self, ids):
        return self.gather(self.embedding_weight, ids, 0)


class LlamaModel(nn.Cell):
    def __init__(self, cfg: LlamaConfig, rng, compute_dtype, flash: bool = False):
        super().__init__()
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std, rng)
        self.layers = nn.CellList([DecoderLayer(cfg, rng, compute_dtype, flash) for _ in range(cfg.num_layers)])
        self.norm_out = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rope_cfg = cfg
        self.set_rope_length(None)
        self.future = Tensor(np.triu(np.ones((rope.window(cfg),) * 2, np.float32), k=1))  # 1: j > i

    def set_rope_length(self, length):
        """Dynamic NTK's tables for sequences of `length` tokens (identity up to max_position_embeddings);
        other scalings do not depend on the length. models/llama build() sets the training length, evaluation
        each context length, generation the cache length. In graph mode a new length is a new input shape,
        hence a new graph that takes the new tables."""
        if length is None or self.rope_cfg.rope_scaling.type == "dynamic":
            cos, sin = rope_tables(self.rope_cfg, length)
            self.cos, self.sin = Tensor(cos), Tensor(sin)

    def construct(self, tokens, positions=None, segments=None):
        """`positions` [B, S] (restarting per packed sample) and `segments` [B, S] (the sample of every token)
        keep attention inside each packed sample; without them: positions 0..S-1, one causal sequence."""
        cos, sin, mask = self.attention_inputs(tokens, positions, segments)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm_out(x)

    def attention_inputs(self, tokens, positions, segments):
        """(cos, sin, mask) for every layer's attention: the RoPE tables [S, D] (or [B, 1, S, D] at `positions`)
        and, with `segments`, the additive bias [B, 1, S, S] that keeps each token inside its sample (else None)."""
        seq = tokens.shape[1]
        if positions is None:
            cos, sin = self.cos[:seq], self.sin[:seq]
        else:  # [B, 1, S, D]: broadcast over the heads
            cos, sin = self.cos[positions].expand_dims(1), self.sin[positions].expand_dims(1)
        if segments is None:
            return cos, sin, None
        same = segments.expand_dims(2) == segments.expand_dims(1)  # [B, S, S]
        allowed = ops.logical_and(same, self.future[:seq, :seq] == 0).astype(ms.float32)
        return cos, sin, ((1.0 - allowed) * -1e9).expand_dims(1)  # [B, 1, S, S], added to the scores

    def cached(self, tokens, positions, bias, k_caches=None, v_caches=None, slot=None):
        """Inference: tokens/positions [B, S] (positions start at 0 at each row's first real token), the
        attention bias and per-layer caches (tuples of Parameters, written in place, or None) -> hidden
        [B, S, hidden]."""
        cos, sin = self.cos[positions].expand_dims(1), self.sin[positions].expand_dims(1)  # [B, 1, S, D]
        x = self.tok_embeddings(tokens)
        i = 0
        for layer in self.layers:
            k = None if k_caches is None else k_caches[i]
            v = None if v_caches is None else v_caches[i]
            x = layer.cached(x, cos, sin, bias, k, v, slot)
            i += 1
        return self.norm_out(x)


class LlamaForCausalLM(nn.Cell):
    """tokens [B, S] int32 -> logits [B, S, vocab] fp32. `flash`: Ascend's flash attention (Attention)."""

    def __init__(self, cfg: LlamaConfig, compute_dtype: str = "fp32", flash: bool = False, seed: int = 0,
                 deferred: bool = False):
        """`deferred`: the weights are initialised by the sharded compile, each rank its slices (_init)."""
        super().__init__()
        rng = None if deferred else np.random.default_rng(seed)  # numpy: identical weights on every rank
        dtype = DTYPES[compute_dtype]
        self.model = LlamaModel(cfg, rng, dtype, flash)
        self.tie_embeddings = cfg.tie_embeddings
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.init_std, rng, dtype)
        else:
            self.head_matmul = ops.MatMul(transpose_b=True)
        self.compute_dtype = dtype

    def layers(self):
        return self.model.layers

    def construct(self, tokens, positions=None, segments=None):
        return self.head(self.model(tokens, positions, segments))

    def head(self, h):
        """Final hidden states [..., hidden] -> fp32 logits [..., vocab] (the LM head, or the tied embedding)."""
        if self.tie_embeddings:
            w = self.model.tok_embeddings.embedding_weight.astype(self.compute_dtype)
            logits = self.head_matmul(h.reshape(-1, h.shape[-1]).astype(self.compute_dtype), w)
            logits = logits.reshape(h.shape[:-1] + (-1,))
        else:
            logits = self.lm_head(h)
        return logits.astype(ms.float32)

    def cached(self, tokens, positions, bias, k_caches=None, v_caches=None, slot=None):
        """Inference step (see Attention.cached): fp32 logits [B, vocab] of the last column only (with left
        padding, every row's newest token); the caches are written in place."""
        return self.head(self.model.cached(tokens, positions, bias, k_caches, v_caches, slot)[:, -1])

    def generate(self, prompts, max_new_tokens: int, **options):
        """Token ids of each prompt (lists of ints) -> their continuations, with a KV cache: see
        models/llama/generation.py `Generator.generate` for the options (sampling, stops, seed, streaming)."""
        from models.llama.generation import generator

        return generator(self).generate(prompts, max_new_tokens, **options)
