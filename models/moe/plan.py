"""How the mixture-of-experts family is laid out over devices: the decoder's tensor, sequence, context and pipeline
parallelism as the Llama family's (models/llama/plan.py says the scheme; models/common/plan.py holds it), and the
experts split over expert parallelism with tensor parallelism inside each expert, placed as MindFormers places its
MoE experts: each group of ep consecutive data-parallel ranks holds all the experts between them, so the
all-to-alls stay inside the group (MindFormers' LlamaFeedForward with expert_num > 1, `_shard_semi_auto_parallel`:
w1/w3 ((dp', ep, 1, 1), (ep, mp, 1)), w2 ((dp', ep, 1, mp), (ep, 1, mp)) on [dp', E, C, h] with dp' = dp x cp / ep
outermost; under cp > 1 it folds cp into dp', where this plan keeps the ep group on dp ranks, as base/validate.py's
ep dividing dp and planner/layout.py's ep_groups have it):

    attention (wq wk wv column-, wo row-parallel), embedding, LM head, norms and residual adds: as Llama's
    shared expert: a SwiGLU like Llama's (w1 w3 column-, w2 row-parallel); its sigmoid gate replicated
    router: replicated [E, h] weight, the tokens by batch (fp32 logits; MindFormers' router dense ((dp, 1), (1, 1)))
    experts [E, C, h] (models/moe/model.py Experts), on the device matrix (dp / ep, ep, cp, tp) (ranks row-major,
    as planner/layout.py numbers them: dp rank = its dp / ep index x ep + its ep index): the E experts over the ep
    axis, their C rows over the rest of the data-parallel ranks (dp / ep and cp), the expert width f over tp:
        up   (x @ w1^T, x @ w3^T):  x (ep, dp / ep x cp, -),  w1 w3 [E, f, h] (ep, tp, -)
        down (a @ w2^T):            a (ep, dp / ep x cp, tp), w2 [E, h, f] (ep, -, tp): partial sums all-reduced
    so dp rank d holds the (d mod ep)-th slice of the experts, and the ranks that exchange tokens are the ep
    consecutive dp ranks at one cp and tp rank: planner/layout.py's ep_groups. MindSpore moves each row from the
    rank that routed it to the rank that holds its expert (the dispatch all-to-all) and back (the combine),
    between the routing's gathers (left at MindSpore's default strategies) and these matmuls: the all-to-alls
    planner/timing.py counts.

The experts' strategies are MindSpore Layouts (the device matrix and each dimension's axis), not tuples: a tuple
strategy orders the device matrix as the tensor's dimensions, which on the [E, C, h] input would put ep outermost
(each slice of the experts on a block of dp / ep ranks). MindFormers' 4-D input [dp', E, C, h] gets the order from
its shape instead, by a BatchMatMul that broadcasts the 3-D weights over dp', which MindSpore runs on Ascend only
(CPU and GPU refuse to broadcast its batch dimensions).

Validation (base/validate.py) keeps ep dividing dp and the experts. MindSpore compiles sharded graphs only for
Ascend/GPU: on CPU this plan is built and checked (tests/test_moe.py), not executed. `python -m distributed.reshard
--ep` lays a checkpoint out by `weight_split` (the expert weights' splits above, ep and tp) on the same placement.
"""
from typing import Dict, Tuple

from mindspore.parallel import Layout

from models.common.plan import (context_parallel_attributes, decoder_strategies, linear_split,  # noqa: F401
                                num_layers_in, pipeline_parts, row_output_strategies, stage_of)
from models.moe.model import Experts, MoeDecoderLayer, MoeForCausalLM

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "shared_expert.w1", "shared_expert.w3", "lm_head")
ROW = ("attention.wo", "shared_expert.w2")
REPLICATED = ("feed_forward.router", "feed_forward.shared_expert_gate")  # small [E or 1, h] weights: whole
EXPERT_WEIGHTS = {"w1": "up", "w3": "up", "w2": "down"}  # Experts' parameter -> the primitive it feeds


def expert_grid(dp: int, tp: int, cp: int = 1, ep: int = 1) -> Layout:
    """The routed experts' device matrix (dp / ep, ep, cp, tp), row-major over a stage's ranks (module docstring)."""
    return Layout((dp // ep, ep, cp, tp), ("dp", "ep", "cp", "tp"))


def expert_strategies(model: MoeForCausalLM, dp: int, tp: int, cp: int = 1, ep: int = 1) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> strategy for the router, the shared expert's gate and the routed experts (these
    as Layouts on expert_grid)."""
    plan = {}
    grid = expert_grid(dp, tp, cp, ep)
    rows = ("dp", "cp")  # each expert's rows: over the data-parallel ranks that share its slice of the experts
    for name, cell in model.cells_and_names():
        if name.endswith(REPLICATED):
            plan[f"{name}.matmul"] = ((dp * cp, 1), (1, 1))
        elif isinstance(cell, Experts):
            plan[f"{name}.up"] = (grid("ep", rows, "None"), grid("ep", "tp", "None"))
            plan[f"{name}.down"] = (grid("ep", rows, "tp"), grid("ep", "None", "tp"))
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
