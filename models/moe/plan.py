"""How the mixture-of-experts family is laid out over devices: the decoder's tensor, sequence, context and pipeline
parallelism as the Llama family's (models/llama/plan.py says the scheme; models/common/plan.py holds it), and the
experts split over expert parallelism with tensor parallelism inside each expert, as MindFormers' expert_parallel
lays out its MoE FeedForward (models/llama/llama_layer.py `_shard_semi_auto_parallel`: w1/w3 ((dp', ep, 1, 1),
(ep, mp, 1)), w2 ((dp', ep, 1, mp), (ep, 1, mp)) with dp' = dp x cp / ep):

    attention (wq wk wv column-, wo row-parallel), embedding, LM head, norms and residual adds: as Llama's
    shared expert: a SwiGLU like Llama's (w1 w3 column-, w2 row-parallel); its sigmoid gate replicated
    router: replicated [E, h] weight, the tokens by batch (fp32 logits; MindFormers' router dense ((dp, 1), (1, 1)))
    experts [E, C, h] (models/moe/model.py Experts): the E experts over ep, their C rows over the rest of the
    data-parallel ranks (dp x cp / ep), the expert width f over tp:
        up   (x @ w1^T, x @ w3^T):  x (ep, dp x cp / ep, 1),  w1 w3 [E, f, h] (ep, tp, 1)
        down (a @ w2^T):            a (ep, dp x cp / ep, tp), w2 [E, h, f] (ep, 1, tp): partial sums all-reduced
    MindSpore moves each row from the rank that routed it to the rank that holds its expert (the dispatch
    all-to-all) and back (the combine), between the routing's gathers (left at MindSpore's default strategies) and
    these matmuls: the all-to-alls planner/timing.py counts.

Validation (base/validate.py) keeps ep dividing dp and the experts. MindSpore compiles sharded graphs only for
Ascend/GPU: on CPU this plan is built and checked (tests/test_moe.py), not executed. `python -m distributed.reshard
--ep` lays a checkpoint out by `weight_split`: the expert weights' tuples above, ep and tp.
"""
from typing import Dict, Tuple

from models.common.plan import (context_parallel_attributes, decoder_strategies, linear_split,  # noqa: F401
                                num_layers_in, pipeline_parts, row_output_strategies, stage_of)
from models.moe.model import Experts, MoeDecoderLayer, MoeForCausalLM

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "shared_expert.w1", "shared_expert.w3", "lm_head")
ROW = ("attention.wo", "shared_expert.w2")
REPLICATED = ("feed_forward.router", "feed_forward.shared_expert_gate")  # small [E or 1, h] weights: whole
EXPERT_WEIGHTS = {"w1": "up", "w3": "up", "w2": "down"}  # Experts' parameter -> the primitive it feeds


def expert_strategies(model: MoeForCausalLM, dp: int, tp: int, cp: int = 1, ep: int = 1) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> strategy for the router, the shared expert's gate and the routed experts."""
    plan = {}
    rows = dp * cp // ep  # each expert's rows: over the data-parallel ranks that share its ep slice
    for name, cell in model.cells_and_names():
        if name.endswith(REPLICATED):
            plan[f"{name}.matmul"] = ((dp * cp, 1), (1, 1))
        elif isinstance(cell, Experts):
            plan[f"{name}.up"] = ((ep, rows, 1), (ep, tp, 1))
            plan[f"{name}.down"] = ((ep, rows, tp), (ep, 1, tp))
    return plan


def tensor_parallel_strategies(model: MoeForCausalLM, dp: int, tp: int, sequence_parallel: bool = False,
                               cp: int = 1, ulysses: int = 1, ep: int = 1) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> strategy, for every primitive that tensor, context and expert parallelism
    shard."""
    plan = decoder_strategies(model, MoeDecoderLayer, COLUMN, ROW, dp, tp, sequence_parallel, cp, ulysses)
    plan.update(expert_strategies(model, dp, tp, cp, ep))
    return plan


def output_strategies(model: MoeForCausalLM, dp: int, tp: int, sequence_parallel: bool = False,
                      cp: int = 1) -> Dict[str, Tuple]:
    """Under sequence parallelism the row-parallel matmuls reduce-scatter their outputs (models/common/plan.py)."""
    return row_output_strategies(model, ROW, dp, tp, sequence_parallel, cp)


def weight_split(name: str, ndim: int, tp: int, ep: int = 1) -> Tuple[int, ...]:
    """How tensor and expert parallelism split parameter `name`: the weight's tuple in its primitive's strategy
    above (distributed/sharded_checkpoint.py asks for the tp and the ep part apart)."""
    owner, _, weight = name.rpartition(".")
    if owner.endswith(".experts") and weight in EXPERT_WEIGHTS:
        return (ep, tp, 1) if EXPERT_WEIGHTS[weight] == "up" else (ep, 1, tp)
    return linear_split(name, ndim, tp, COLUMN, ROW)
