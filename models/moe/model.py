"""A mixture-of-experts decoder as MindSpore cells: Llama's decoder (models/common/ blocks: RMSNorm, RoPE, GQA
attention, the embedding) whose feed-forward is MoeFeedForward.

token embedding -> N x [RMSNorm -> causal self-attention -> residual,
                        RMSNorm -> router -> top-k of E SwiGLU experts (+ shared expert) -> residual]
                -> RMSNorm -> LM head

Routing (per token x, router logits z = x W_r^T, fp32): p = softmax(z) over the E experts, its top-k (experts
e_1..e_k, weights p_e), renormalised to sum 1 when model.norm_topk_prob (Mixtral) or kept (Qwen2-MoE's default,
DeepSeek-MoE); y = sum_i w_i expert_{e_i}(x) [+ sigmoid(x w_g) shared(x) with a gated shared expert (Qwen2-MoE),
+ shared(x) without]. Each expert is SwiGLU: w2(silu(w1 x) * w3 x), its weights stacked over the experts
([E, f, h], [E, h, f]) so all experts run as one batched matmul.

Dispatch with static shapes (graph mode compiles one graph): the T x k assignments, first choices of all tokens
before second choices (Switch / GShard priority), get a position in their expert's queue; an expert holds C rows:
C = T dropless (model.capacity_factor null: no token is ever dropped, at the cost of E x T rows of compute) or
ceil(capacity_factor x T x k / E); an assignment past C is dropped (its output zero, the residual carries the
token). The rows are gathered into [E, C, h], run, and gathered back; gradients flow through the gathers and the
routing weights (so to the router).

Auxiliary losses, over all layers' tokens as transformers' `load_balancing_loss_func` computes them:
  balance = E * sum_{i,e} f_{i,e} P_e, f_{i,e} the share of tokens whose i-th choice is e, P_e the mean router
            probability of e (Switch Transformer eq. 4, Mixtral's form with k choices)
  z       = mean over tokens of logsumexp(z)^2 (ST-MoE)
The trunk's `with_aux` (the training forward) returns aux_loss_coef * balance + z_loss_coef * z
(models/common/causal_lm.py), and keeps the step's router statistics (balance, z, the busiest expert's load over the
mean, the dropped share) in the non-trainable `model.router_stats` for the console (models/moe/__init__.py
step_metrics); its plain forward (construct: validation, evaluation, scoring, generation) adds and records nothing.
"""
import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from models.common import rope
from models.common.attention import Attention, rope_tables
from models.common.causal_lm import CausalLM
from models.common.layers import Embedding, FeedForward, Linear, ReusedLayer, RMSNorm, _init
from models.common.trunk import DecoderTrunk
from models.moe.config import MoeConfig

STATS = ("router_balance", "router_z", "expert_load_max", "dropped_share")  # model.router_stats, in order


class Experts(nn.Cell):
    """E SwiGLU experts on x [E, C, h] -> [E, C, h], weights stacked: w1, w3 [E, f, h], w2 [E, h, f]."""

    def __init__(self, cfg: MoeConfig, rng, compute_dtype):
        super().__init__()
        e, h, f, std = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size, cfg.init_std
        self.w1, self.w3 = _init(rng, (e, f, h), std), _init(rng, (e, f, h), std)
        self.w2 = _init(rng, (e, h, f), std)
        self.compute_dtype = compute_dtype
        # two primitives: expert parallelism splits w1 / w3 and w2 differently (models/moe/plan.py)
        self.up, self.down = ops.BatchMatMul(transpose_b=True), ops.BatchMatMul(transpose_b=True)

    def construct(self, x):
        x = x.astype(self.compute_dtype)
        gate = self.up(x, self.w1.astype(self.compute_dtype))
        up = self.up(x, self.w3.astype(self.compute_dtype))
        return self.down(ops.silu(gate) * up, self.w2.astype(self.compute_dtype))


class MoeFeedForward(nn.Cell):
    """x [B, S, h] -> (y [B, S, h], router statistics): the routed experts (+ the shared one)."""

    def __init__(self, cfg: MoeConfig, rng, compute_dtype):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.top_k, cfg.norm_topk_prob
        self.capacity_factor = 0.0 if cfg.capacity_factor is None else float(cfg.capacity_factor)  # 0: dropless
        self.router = Linear(cfg.hidden_size, cfg.num_experts, cfg.init_std, rng, ms.float32)  # fp32 logits
        self.experts = Experts(cfg, rng, compute_dtype)
        self.shared = cfg.shared_expert_intermediate_size > 0
        self.gated = self.shared and cfg.shared_expert_gate
        if self.shared:
            self.shared_expert = FeedForward(cfg, rng, compute_dtype, cfg.shared_expert_intermediate_size)
        if self.gated:
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, cfg.init_std, rng, compute_dtype)
        self.biased = cfg.bias_update_rate > 0
        if self.biased:  # DeepSeek-V3's balancing: the bias (moved by update_routing_bias) and the assignments
            # per expert it reads (added by MoeModel.with_aux, the training forward)
            zeros = np.zeros(cfg.num_experts, np.float32)
            self.routing_bias = Parameter(Tensor(zeros), name="routing_bias", requires_grad=False)
            self.expert_load = Parameter(Tensor(zeros), name="expert_load", requires_grad=False)

    def construct(self, x, dropless: bool = False):
        """`dropless`: every assignment computed whatever model.capacity_factor (inference). Returns y and
        (router logits [T, E], the tokens choosing each expert per rank i [k, E], probabilities summed [E],
        dropped assignments) for the auxiliary losses and the console."""
        b, s, h = x.shape
        tokens = b * s
        flat = x.reshape(tokens, h)
        logits = self.router(flat.astype(ms.float32)).astype(ms.float32)  # [T, E]
        probs = ops.softmax(logits, -1)
        if self.biased:  # the choice by the biased probabilities, the weights the unbiased ones
            chosen = ops.topk(probs + self.routing_bias, self.top_k)[1]
            weights = ops.gather_elements(probs, 1, chosen)
        else:
            weights, chosen = ops.topk(probs, self.top_k)  # [T, k], largest first
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdims=True)
        e = self.num_experts
        rows = tokens  # each expert's room: every token (dropless), or ceil(c x tokens x k / E)
        if not dropless and self.capacity_factor > 0:
            rows = min(tokens, max(1, int(-(-(self.capacity_factor * tokens * self.top_k) // e))))
        choice = chosen.transpose(1, 0).reshape(-1)  # [k T]: every token's first choice, then the second...
        onehot = ops.one_hot(choice, e, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))  # [k T, E]
        position = ((ops.cumsum(onehot, 0) - 1.0) * onehot).sum(-1).astype(ms.int32)  # place in its expert's queue
        kept = position < rows
        slot = ops.select(kept, choice * rows + position, ops.full_like(position, e * rows))  # dropped: a spare slot
        token = ops.arange(0, self.top_k * tokens, dtype=ms.int32) % tokens
        table = ops.tensor_scatter_update(ops.zeros((e * rows + 1,), ms.int32), slot.reshape(-1, 1), token)
        routed = self.experts(ops.gather(flat, table[:e * rows], 0).reshape(e, rows, h))  # [E, C, h]
        routed = ops.cat((routed.reshape(e * rows, h), ops.zeros((1, h), routed.dtype)))  # the spare slot: 0
        weight = weights.transpose(1, 0).reshape(-1) * kept.astype(ms.float32)  # [k T]
        y = (ops.gather(routed, slot, 0).astype(ms.float32) * weight.expand_dims(-1)).reshape(
            self.top_k, tokens, h).sum(0)
        if self.shared:
            shared = self.shared_expert(flat).astype(ms.float32)
            if self.gated:
                shared = shared * ops.sigmoid(self.shared_expert_gate(flat).astype(ms.float32))
            y = y + shared
        dropped = (1.0 - kept.astype(ms.float32)).sum()
        return y.reshape(b, s, h).astype(x.dtype), (logits, onehot.reshape(self.top_k, tokens, e).sum(1),
                                                    probs.sum(0), dropped)


def update_routing_bias(model, rate: float) -> None:
    """DeepSeek-V3's bias update after a step, in each layer: b_e += rate x sign(1/E - load_e), load_e the share of
    the step's assignments expert e got (every micro-batch's: the counts `with_aux` added since the last update),
    then the counts restart from zero: an overloaded expert's bias falls, an idle one's rises (MindFormers'
    TopkBiasBalanceCallback, its balance_via_topk_bias, which sums its router's expert_load the same way and leaves
    a layer that counted nothing as it is)."""
    for layer in model.model.layers:
        ffn = layer.feed_forward
        counts = ffn.expert_load.asnumpy()
        if not counts.any():  # nothing routed since the last update (no loss token in the step): as MindFormers
            continue
        load = counts / counts.sum()
        bias = ffn.routing_bias.asnumpy() + rate * np.sign(1.0 / load.size - load)
        ffn.routing_bias.set_data(Tensor(bias.astype(np.float32)))
        ffn.expert_load.set_data(Tensor(np.zeros_like(counts)))


class MoeDecoderLayer(ReusedLayer):
    """Compiled once and reused for every layer (ReusedLayer, models/common/layers.py). Its router state (the
    routing bias and the `expert_load` counts with_aux adds to) is each layer's own Parameters."""

    @ms.lazy_inline(policy="front")
    def __init__(self, cfg: MoeConfig, rng, compute_dtype, flash: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg, rng, compute_dtype, flash)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = MoeFeedForward(cfg, rng, compute_dtype)
        self.attention_residual, self.ffn_residual = ops.Add(), ops.Add()  # primitives: plan.py shards them

    def construct(self, x, cos, sin, mask=None):
        x = self.attention_residual(x, self.attention(self.attention_norm(x), cos, sin, mask).astype(x.dtype))
        y, stats = self.feed_forward(self.ffn_norm(x))
        return self.ffn_residual(x, y.astype(x.dtype)), stats

    def cached(self, x, cos, sin, bias, k_cache=None, v_cache=None, slot=None):
        x = x + self.attention.cached(self.attention_norm(x), cos, sin, bias, k_cache, v_cache, slot).astype(x.dtype)
        return x + self.feed_forward(self.ffn_norm(x), True)[0].astype(x.dtype)


class MoeModel(DecoderTrunk):
    """The trunk: tokens -> final hidden states; `with_aux` adds the routers' auxiliary loss."""

    def __init__(self, cfg: MoeConfig, rng, compute_dtype, flash: bool = False):
        super().__init__()
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std, rng)
        self.layers = nn.CellList([MoeDecoderLayer(cfg, rng, compute_dtype, flash) for _ in range(cfg.num_layers)])
        self.norm_out = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rope_cfg = cfg
        cos, sin = rope_tables(cfg)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        self.future = Tensor(np.triu(np.ones((rope.window(cfg),) * 2, np.float32), k=1))  # 1: j > i
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.aux_coef, self.z_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router_stats = Parameter(Tensor(np.zeros(len(STATS), np.float32)), name="router_stats",
                                      requires_grad=False)

    def set_rope_length(self, length):
        """No length-dependent RoPE here (model.rope_scaling type none): the tables stay."""

    def construct(self, tokens, positions=None, segments=None):
        """The plain forward (validation, evaluation, scoring): no auxiliary loss, nothing recorded."""
        cos, sin, mask = self.attention_inputs(tokens, positions, segments)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)[0]
        return self.norm_out(x)

    def with_aux(self, tokens, positions=None, segments=None):
        """The training forward: (final hidden states [B, S, h], aux_loss_coef x balance + z_loss_coef x z); it
        keeps the router statistics for the console and, with a routing bias, adds each layer's assignments per
        expert to its `expert_load` (summed over the step's micro-batches until update_routing_bias reads them)."""
        cos, sin, mask = self.attention_inputs(tokens, positions, segments)
        x = self.tok_embeddings(tokens)
        z, choices, probs, dropped = 0.0, 0.0, 0.0, 0.0
        for layer in self.layers:
            x, (logits, layer_choices, layer_probs, layer_dropped) = layer(x, cos, sin, mask)
            z = z + (ops.logsumexp(logits, -1) ** 2).sum()
            choices, probs, dropped = choices + layer_choices, probs + layer_probs, dropped + layer_dropped
            if layer.feed_forward.biased:
                load = layer.feed_forward.expert_load
                x = ops.depend(x, ops.assign_add(load, ops.stop_gradient(layer_choices.sum(0))))
        routed = tokens.shape[0] * tokens.shape[1] * len(self.layers)  # tokens x layers
        balance = self.num_experts * (choices / routed * (probs / routed).expand_dims(0)).sum()
        z = z / routed
        load = choices.sum(0)  # [E] assignments per expert, all layers
        stats = ops.stack((balance, z, load.max() / load.mean(), dropped / (routed * self.top_k)))
        hidden = ops.depend(self.norm_out(x), ops.assign(self.router_stats, ops.stop_gradient(stats)))
        return hidden, self.aux_coef * balance + self.z_coef * z


class MoeForCausalLM(CausalLM):
    """tokens [B, S] int32 -> logits [B, S, vocab] fp32; the causal-LM interface with the routers' aux loss."""

    family = "moe"  # the family that builds it (what a converter asks: LoRA's default targets)

    HAS_AUX = True

    def __init__(self, cfg: MoeConfig, compute_dtype: str = "fp32", flash: bool = False, seed: int = 0,
                 deferred: bool = False):
        super().__init__()
        self.assemble(cfg, MoeModel, compute_dtype, flash, seed, deferred)

    def cached(self, tokens, positions, bias, k_caches=None, v_caches=None, slot=None):
        """Inference step: fp32 logits [B, vocab] of the last column (models/common/generation.py)."""
        return self.head(self.model.cached(tokens, positions, bias, k_caches, v_caches, slot)[:, -1])

    def router_logits(self, tokens):
        """Every layer's router logits [L, B x S, E] (dropless), as transformers' output_router_logits."""
        cos, sin, _ = self.model.attention_inputs(tokens, None, None)
        x = self.model.tok_embeddings(tokens)
        out = []
        for layer in self.model.layers:
            x = x + layer.attention(layer.attention_norm(x), cos, sin).astype(x.dtype)
            y, stats = layer.feed_forward(layer.ffn_norm(x), True)
            x = x + y.astype(x.dtype)
            out.append(stats[0])
        return ops.stack(out)
