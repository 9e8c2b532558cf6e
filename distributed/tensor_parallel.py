"""Tensor parallelism for the native Llama, MindSpore's way: `shard()` strategies on its primitives under
SEMI_AUTO_PARALLEL, in Megatron's layout. The model's code is untouched; this module only annotates it.

    column-parallel (weight split by output rows):  wq wk wv, w1 w3 (SwiGLU gate/up), lm_head (vocab)
    row-parallel    (weight split by input columns): wo, w2 — MindSpore inserts the AllReduce after them
    attention scores/values: split by head;  embedding: vocab-parallel gather
    sequence parallel (optional): RMSNorm's primitives split the sequence over tp, so activations outside
    attention/MLP are not replicated; MindSpore inserts the all-gather / reduce-scatter around them

A strategy is one tuple per input, giving how many ways each dimension is split (dp on the batch, tp on the
sharded dimension). MindSpore compiles sharded graphs only for Ascend/GPU: on CPU these strategies can be
built and checked (tests do), not executed.
"""
from typing import Dict, Tuple

from mindspore import nn

from models.llama import CoreAttention, Embedding, Linear, LlamaForCausalLM, RMSNorm

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "lm_head")
ROW = ("attention.wo", "feed_forward.w2")


def tensor_parallel_strategies(model: LlamaForCausalLM, dp: int, tp: int,
                               sequence_parallel: bool = False) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> strategy, for every primitive that tensor parallelism shards."""
    plan = {}
    if sequence_parallel:
        act = (dp, tp, 1)  # [batch, sequence, hidden]
        for name, cell in model.cells_and_names():
            if isinstance(cell, RMSNorm):
                plan.update({f"{name}.square": (act,), f"{name}.mean": (act,), f"{name}.add": (act, ()),
                             f"{name}.rsqrt": (act,), f"{name}.normalize": (act, act), f"{name}.scale": (act, (1,))})
    for name, cell in model.cells_and_names():
        if isinstance(cell, Linear) and name.endswith(COLUMN):
            plan[f"{name}.matmul"] = ((dp, 1), (tp, 1))
        elif isinstance(cell, Linear) and name.endswith(ROW):
            plan[f"{name}.matmul"] = ((dp, tp), (1, tp))
        elif isinstance(cell, CoreAttention):
            plan[f"{name}.qk"] = plan[f"{name}.pv"] = ((dp, tp, 1, 1), (dp, tp, 1, 1))
        elif isinstance(cell, Embedding):
            plan[f"{name}.gather"] = ((tp, 1), (dp, 1))
    if model.tie_embeddings:
        plan["head_matmul"] = ((dp, 1), (tp, 1))
    return plan


def weight_split(name: str, ndim: int, tp: int) -> Tuple[int, ...]:
    """How tensor parallelism splits parameter `name`: the weight's tuple in its primitive's strategy above."""
    if name.endswith(tuple(f"{cell}.weight" for cell in COLUMN)) or name.endswith("embedding_weight"):
        return (tp, 1)  # column-parallel weights [out, in] and the vocab-parallel embedding [vocab, hidden]
    if name.endswith(tuple(f"{cell}.weight" for cell in ROW)):
        return (1, tp)
    return (1,) * ndim  # norms: replicated


def apply_tensor_parallel(model: nn.Cell, dp: int, tp: int, sequence_parallel: bool = False) -> Dict[str, Tuple]:
    """Shard the model's primitives (call under SEMI_AUTO_PARALLEL); returns the plan applied."""
    cells = dict(model.cells_and_names())
    plan = tensor_parallel_strategies(model, dp, tp, sequence_parallel)
    for path, strategy in plan.items():
        owner, _, primitive = path.rpartition(".")
        getattr(cells[owner], primitive).shard(strategy)
    return plan
