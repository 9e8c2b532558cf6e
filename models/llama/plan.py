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
    sub-cells a converter adds to a linear cell (LoRA's adapters) follow their base by the converter's rules
    (adapters/sharding.py): this plan lays out the linear cells only

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
import re
from typing import Dict, Iterable, List, Optional, Tuple

from adapters.sharding import followed_split, followers
from models.llama.device_ops import FusedRMSNorm
from models.llama.model import (AttentionBlock, DecoderLayer, Embedding, FlashCoreAttention, Linear, LlamaForCausalLM,
                                RMSNorm)

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "lm_head")
ROW = ("attention.wo", "feed_forward.w2")
_LAYER = re.compile(r"^model\.layers\.(\d+)(\.|$)")


def tensor_parallel_strategies(model: LlamaForCausalLM, dp: int, tp: int, sequence_parallel: bool = False,
                               cp: int = 1, ulysses: int = 1) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> strategy, for every primitive that tensor (and context) parallelism shards."""
    plan = {}
    ring = cp // ulysses
    if sequence_parallel:
        act = (dp, cp * tp, 1)  # [batch, sequence, hidden]: the batch over dp, the sequence over cp and tp
        for name, cell in model.cells_and_names():
            if isinstance(cell, FusedRMSNorm):
                plan[f"{name}.norm"] = (act, (1,))
            elif isinstance(cell, RMSNorm):  # 1/rms is [batch, sequence, 1]: split as x
                plan.update({f"{name}.square": (act,), f"{name}.mean": (act,), f"{name}.add": (act, ()),
                             f"{name}.rsqrt": (act,), f"{name}.normalize": (act, act), f"{name}.scale": (act, (1,))})
    act = (dp, cp * (tp if sequence_parallel else 1), 1)  # the residual stream: the sequence over cp (and tp)
    for name, cell in model.cells_and_names():
        if isinstance(cell, DecoderLayer):
            plan[f"{name}.attention_residual"] = plan[f"{name}.ffn_residual"] = (act, act)
    heads = (dp, tp, 1, 1)  # [batch, heads, sequence, head_dim]
    tokens = dp * cp  # the linears' [batch x sequence] rows
    for name, cell in model.cells_and_names():
        if isinstance(cell, Linear) and name.endswith(COLUMN):
            plan.update(_linear(name, cell, ((tokens, 1), (tp, 1))))
        elif isinstance(cell, Linear) and name.endswith(ROW):
            plan.update(_linear(name, cell, ((tokens, tp), (1, tp))))
        elif isinstance(cell, AttentionBlock):
            plan[f"{name}.qk"] = plan[f"{name}.pv"] = (heads, heads)
        elif isinstance(cell, FlashCoreAttention):  # inputs q, k, v and the mask (the unused ones are None)
            split = (dp, tp * ulysses, ring, 1)  # heads over tp x ulysses, the sequence over the ring
            plan[f"{name}.causal"] = (split, split, split, (1, 1))
            plan[f"{name}.masked"] = (split, split, split, (dp, 1, ring, 1))
        elif isinstance(cell, Embedding):
            plan[f"{name}.gather"] = ((tp, 1), (dp, cp))
    if model.tie_embeddings:
        plan["head_matmul"] = ((dp, 1), (tp, 1))
    return plan


def _linear(name: str, cell: Linear, strategy: Tuple) -> Dict[str, Tuple]:
    """A linear cell's matmul strategy, and those of the sub-cells a converter added to it (adapters/sharding.py)."""
    return {f"{name}.matmul": strategy, **followers(name, cell, strategy)}


def output_strategies(model: LlamaForCausalLM, dp: int, tp: int, sequence_parallel: bool = False,
                      cp: int = 1) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> output strategy, where one is set: under sequence parallelism the row-parallel
    matmuls' [batch x sequence, hidden] outputs split over dp x cp x tp (a reduce-scatter, not an all-reduce)."""
    if not sequence_parallel:
        return {}
    return {f"{name}.matmul": ((dp * cp * tp, 1),) for name, cell in model.cells_and_names()
            if isinstance(cell, Linear) and name.endswith(ROW)}


def context_parallel_attributes(model: LlamaForCausalLM, cp: int, ulysses: int) -> Dict[str, Dict[str, bool]]:
    """`<cell path>.<primitive>` -> primitive attributes: MindSpore's ring attention on flash attention when the
    ring has more than one rank (the attributes MindFormers' FlashAttention sets for its ring)."""
    if cp // ulysses == 1:
        return {}
    ring = {"enable_ring_attention": True, "enable_ra_send_recv": True}
    return {f"{name}.{primitive}": ring for name, cell in model.cells_and_names()
            if isinstance(cell, FlashCoreAttention) for primitive in ("causal", "masked")}


def weight_split(name: str, ndim: int, tp: int) -> Tuple[int, ...]:
    """How tensor parallelism splits parameter `name`: the weight's tuple in its primitive's strategy above."""
    follower = followed_split(name, lambda base: weight_split(base, 2, tp))  # a converter's sub-cell weight
    if follower is not None:
        return follower
    if name.endswith(tuple(f"{cell}.weight" for cell in COLUMN)) or name.endswith("embedding_weight"):
        return (tp, 1)  # column-parallel weights [out, in], the vocab-parallel embedding
    if name.endswith(tuple(f"{cell}.weight" for cell in ROW)):
        return (1, tp)
    return (1,) * ndim  # norms: replicated


def stage_of(path: str, num_layers: int, pp: int) -> Optional[int]:
    """Stage of a cell or parameter path; None for what no stage owns (a step counter)."""
    if path.startswith("model.tok_embeddings"):
        return 0
    layer = _LAYER.match(path)
    if layer:
        return int(layer.group(1)) // (num_layers // pp)
    if path.startswith(("model.norm_out", "lm_head")):
        return pp - 1
    return None


def pipeline_parts(model: LlamaForCausalLM) -> List[str]:
    """The cell paths that get a `pipeline_stage`, in order."""
    num_layers = len(model.model.layers)
    parts = ["model.tok_embeddings", *(f"model.layers.{i}" for i in range(num_layers)), "model.norm_out"]
    return parts if model.tie_embeddings else parts + ["lm_head"]


def num_layers_in(names: Iterable[str]) -> int:
    """The decoder layer count of a checkpoint, from its tensor names."""
    return 1 + max(int(m.group(1)) for m in map(_LAYER.match, names) if m)
