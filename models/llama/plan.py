"""How the Llama family is laid out over devices: Megatron-style tensor parallelism and pipeline stages.

Tensor parallelism, MindSpore's way: `shard()` strategies on the model's primitives under SEMI_AUTO_PARALLEL
(applied by distributed/semi_auto.py; the model's code is untouched):

    column-parallel (weight split by output rows):  wq wk wv, w1 w3 (SwiGLU gate/up), lm_head (vocab)
    row-parallel    (weight split by input columns): wo, w2 — MindSpore inserts the AllReduce after them
    attention scores/values: split by head; flash attention (FlashAttentionScore) too, q, k and v by head over
    tp and by batch over dp, the compressed causal mask replicated, a packed-sample mask by batch (MindFormers'
    FlashAttention.shard, BNSD); GQA's kv heads are split over tp like the query heads (validation: tp | kv heads)
    embedding: vocab-parallel gather
    sequence parallel (optional): RMSNorm's primitives (Ascend's fused RmsNorm where device_ops.py put it) and
    the residual adds split the sequence over tp, so activations outside attention/MLP are not replicated; the
    row-parallel matmuls get the output strategy (dp * tp, 1) (`output_strategies`, MindFormers'
    out_strategy_matmul), so MindSpore reduce-scatters their partial sums into sequence slices instead of
    all-reducing them whole, and all-gathers the sequence before the column-parallel matmuls. Without it the
    residual adds are split by batch over dp, as the activations they add
    LoRA adapters (adapters/lora.py) follow their base: on a column-parallel linear B [out, r] is split by
    rows like W and A is replicated; on a row-parallel one A [r, in] is split by columns like W (its partial
    products are summed by the AllReduce MindSpore inserts) and B is replicated

Context parallelism (cp, of which `ulysses` ranks split heads and cp / ulysses run the ring): the tokens split over
dp x cp in the linears (their [batch x sequence, hidden] input), the sequence over cp x tp under sequence
parallelism, the embedding's token ids by batch and sequence; flash attention takes the heads over tp x ulysses
(MindSpore redistributes the sequence shards into head shards: Ulysses' all-to-all) and the sequence over the ring's
ranks, with MindSpore's ring attention switched on by the primitive attributes of context_parallel_attributes.

A strategy is one tuple per input, giving how many ways each dimension is split (dp on the batch, tp on the
sharded dimension).

Pipeline parallelism: each decoder layer gets a `pipeline_stage`; stages own contiguous, equal runs of layers
(base/validate.py requires pp | num_layers); the embedding sits on the first stage, the final norm and LM head
on the last. MindSpore compiles sharded graphs only for Ascend/GPU: on CPU this plan is built and checked
(tests do), not executed.
"""
from typing import Dict, Tuple

from models.common.plan import (context_parallel_attributes, decoder_strategies, linear_split,  # noqa: F401
                                num_layers_in, pipeline_parts, row_output_strategies, stage_of)
from models.llama.device_ops import FusedRMSNorm
from models.llama.model import DecoderLayer, LlamaForCausalLM

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "lm_head")
ROW = ("attention.wo", "feed_forward.w2")


def tensor_parallel_strategies(model: LlamaForCausalLM, dp: int, tp: int, sequence_parallel: bool = False,
                               cp: int = 1, ulysses: int = 1, ep: int = 1) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> strategy, for every primitive that tensor (and context) parallelism shards.
    `ep`: no experts here (validation keeps it 1)."""
    return decoder_strategies(model, DecoderLayer, COLUMN, ROW, dp, tp, sequence_parallel, cp, ulysses,
                              fused_norms=(FusedRMSNorm,))


def output_strategies(model: LlamaForCausalLM, dp: int, tp: int, sequence_parallel: bool = False,
                      cp: int = 1) -> Dict[str, Tuple]:
    """Under sequence parallelism the row-parallel matmuls reduce-scatter their outputs (models/common/plan.py)."""
    return row_output_strategies(model, ROW, dp, tp, sequence_parallel, cp)


def weight_split(name: str, ndim: int, tp: int) -> Tuple[int, ...]:
    """How tensor parallelism splits parameter `name`: the weight's tuple in its primitive's strategy above."""
    return linear_split(name, ndim, tp, COLUMN, ROW)
