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

The blocks (Linear, RMSNorm, SwiGLU, the embedding: models/common/layers.py; attention and RoPE:
models/common/attention.py) are shared with the other decoder families; the names above are re-exported here for
the twins and the plan. Attention: CoreAttention on [B, heads, S, D] (the kv heads repeated for GQA), or Ascend's flash attention
(`model.flash_attention`: the FlashAttentionScore primitive, kv heads as they are). This file is plain MindSpore and
runs everywhere; converters replace some of its cells after the build without changing it: LoRA (adapters/lora.py),
the device twins above and, on CPU, the compiled kernels' twins (models/llama/kernels.py), each where the family's
build finds they apply (models/llama/__init__.py). The tensor/pipeline plan (plan.py) sets its strategies on the
primitives here.

Inference (`LlamaForCausalLM.generate`, models/common/generation.py) goes through the `cached` methods: the same
weights and operations as `construct`, plus a static-shape KV cache per layer ([B, n_kv_heads, L, head_dim] for
K and V: the kv heads, not their GQA repeats; Parameters, written in place), an additive attention bias for
left-padded batches and per-row positions. `construct` (training) does not use them.
"""
import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from models.common import rope
from models.common.attention import (AttentionBlock, Attention, CoreAttention, FlashCoreAttention, Rotary,  # noqa: F401
                                     apply_rope, rope_tables, rotate_half)
from models.common.causal_lm import CausalLM
from models.common.layers import DTYPES, Embedding, FeedForward, Linear, ReusedLayer, RMSNorm  # noqa: F401
from models.common.trunk import DecoderTrunk
from models.llama.config import LlamaConfig


class DecoderLayer(ReusedLayer):
    """Compiled once and reused for every layer (ReusedLayer, models/common/layers.py): the ForwardBackward graph
    compiles sooner, and so the first optimizer step comes sooner, with the same losses and tokens/s
    (benchmarks/speed_memory.py measures the compile and the steps)."""

    @ms.lazy_inline(policy="front")
    def __init__(self, cfg: LlamaConfig, rng, compute_dtype, flash: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg, rng, compute_dtype, flash)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg, rng, compute_dtype)
        self.attention_residual, self.ffn_residual = ops.Add(), ops.Add()  # primitives: plan.py shards them

    def construct(self, x, cos, sin, mask=None):
        x = self.attention_residual(x, self.attention(self.attention_norm(x), cos, sin, mask).astype(x.dtype))
        return self.ffn_residual(x, self.feed_forward(self.ffn_norm(x)).astype(x.dtype))

    def cached(self, x, cos, sin, bias, k_cache=None, v_cache=None, slot=None):
        x = x + self.attention.cached(self.attention_norm(x), cos, sin, bias, k_cache, v_cache, slot).astype(x.dtype)
        return x + self.feed_forward(self.ffn_norm(x)).astype(x.dtype)


class LlamaModel(DecoderTrunk):
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


class LlamaForCausalLM(CausalLM):
    """tokens [B, S] int32 -> logits [B, S, vocab] fp32. `flash`: Ascend's flash attention (Attention)."""

    family = "llama"  # the family that builds it (what a converter asks: LoRA's default targets)

    def __init__(self, cfg: LlamaConfig, compute_dtype: str = "fp32", flash: bool = False, seed: int = 0,
                 deferred: bool = False):
        super().__init__()
        self.assemble(cfg, LlamaModel, compute_dtype, flash, seed, deferred)

    def construct(self, tokens, positions=None, segments=None):
        return self.head(self.model(tokens, positions, segments))

    def cached(self, tokens, positions, bias, k_caches=None, v_caches=None, slot=None):
        """Inference step (see Attention.cached): fp32 logits [B, vocab] of the last column only (with left
        padding, every row's newest token); the caches are written in place."""
        return self.head(self.model.cached(tokens, positions, bias, k_caches, v_caches, slot)[:, -1])

    def generate(self, prompts, max_new_tokens: int, **options):
        """Token ids of each prompt (lists of ints) -> their continuations, with a KV cache: see
        models/common/generation.py `Generator.generate` for the options (sampling, stops, seed, streaming)."""
        from models.common.generation import generator

        return generator(self).generate(prompts, max_new_tokens, **options)
