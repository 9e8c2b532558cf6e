"""How a decoder built of models/common/ blocks is laid out over devices: Megatron-style tensor parallelism,
sequence and context parallelism, and pipeline stages, as `shard()` strategies on its primitives and
`pipeline_stage`s on its parts. Each family's plan.py (models/llama/plan.py says the scheme) binds these to its own
cells: which linears are column- or row-parallel, its decoder layer's residual adds, what it adds (experts).

A strategy is one tuple per input, giving how many ways each dimension is split.
"""
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from models.common.attention import AttentionBlock, FlashCoreAttention
from models.common.layers import Embedding, Linear, RMSNorm

_LAYER = re.compile(r"^model\.layers\.(\d+)(\.|$)")


def decoder_strategies(model, layer_cls: type, column: Sequence[str], row: Sequence[str], dp: int, tp: int,
                       sequence_parallel: bool = False, cp: int = 1, ulysses: int = 1,
                       fused_norms: tuple = ()) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> strategy for the decoder's shared parts: the norms and `layer_cls`'s residual
    adds (`attention_residual`, `ffn_residual`), the linears whose paths end in `column` / `row`, the attention
    core, the embedding and a tied head. `fused_norms`: norm cells of one `norm` primitive (a device kernel)."""
    plan = {}
    ring = cp // ulysses
    if sequence_parallel:
        act = (dp, cp * tp, 1)  # [batch, sequence, hidden]: the batch over dp, the sequence over cp and tp
        for name, cell in model.cells_and_names():
            if isinstance(cell, fused_norms):
                plan[f"{name}.norm"] = (act, (1,))
            elif isinstance(cell, RMSNorm):  # 1/rms is [batch, sequence, 1]: split as x
                plan.update({f"{name}.square": (act,), f"{name}.mean": (act,), f"{name}.add": (act, ()),
                             f"{name}.rsqrt": (act,), f"{name}.normalize": (act, act), f"{name}.scale": (act, (1,))})
    act = (dp, cp * (tp if sequence_parallel else 1), 1)  # the residual stream: the sequence over cp (and tp)
    for name, cell in model.cells_and_names():
        if isinstance(cell, layer_cls):
            plan[f"{name}.attention_residual"] = plan[f"{name}.ffn_residual"] = (act, act)
    heads = (dp, tp, 1, 1)  # [batch, heads, sequence, head_dim]
    tokens = dp * cp  # the linears' [batch x sequence] rows
    column, row = tuple(column), tuple(row)
    for name, cell in model.cells_and_names():
        lora = hasattr(cell, "lora_A")
        if isinstance(cell, Linear) and name.endswith(column):
            plan[f"{name}.matmul"] = ((tokens, 1), (tp, 1))
            if lora:
                plan[f"{name}.lora_A.matmul"] = ((tokens, 1), (1, 1))
                plan[f"{name}.lora_B.matmul"] = ((tokens, 1), (tp, 1))
        elif isinstance(cell, Linear) and name.endswith(row):
            plan[f"{name}.matmul"] = ((tokens, tp), (1, tp))
            if lora:
                plan[f"{name}.lora_A.matmul"] = ((tokens, tp), (1, tp))
                plan[f"{name}.lora_B.matmul"] = ((tokens, 1), (1, 1))
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


def row_output_strategies(model, row: Sequence[str], dp: int, tp: int, sequence_parallel: bool = False,
                          cp: int = 1) -> Dict[str, Tuple]:
    """`<cell path>.<primitive>` -> output strategy, where one is set: under sequence parallelism the row-parallel
    matmuls' [batch x sequence, hidden] outputs split over dp x cp x tp (a reduce-scatter, not an all-reduce)."""
    if not sequence_parallel:
        return {}
    return {f"{name}.matmul": ((dp * cp * tp, 1),) for name, cell in model.cells_and_names()
            if isinstance(cell, Linear) and name.endswith(tuple(row))}


def context_parallel_attributes(model, cp: int, ulysses: int) -> Dict[str, Dict[str, bool]]:
    """`<cell path>.<primitive>` -> primitive attributes: MindSpore's ring attention on flash attention when the
    ring has more than one rank (the attributes MindFormers' FlashAttention sets for its ring)."""
    if cp // ulysses == 1:
        return {}
    ring = {"enable_ring_attention": True, "enable_ra_send_recv": True}
    return {f"{name}.{primitive}": ring for name, cell in model.cells_and_names()
            if isinstance(cell, FlashCoreAttention) for primitive in ("causal", "masked")}


def linear_split(name: str, ndim: int, tp: int, column: Sequence[str], row: Sequence[str]) -> Tuple[int, ...]:
    """How tensor parallelism splits parameter `name` of a linear, the embedding or a norm: the weight's tuple in
    its primitive's strategy above."""
    if name.endswith(tuple(f"{cell}.{w}" for cell in column for w in ("weight", "lora_B.weight"))) or \
            name.endswith("embedding_weight"):
        return (tp, 1)  # column-parallel weights [out, in] (and LoRA's B), the vocab-parallel embedding
    if name.endswith(tuple(f"{cell}.{w}" for cell in row for w in ("weight", "lora_A.weight"))):
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


def pipeline_parts(model) -> List[str]:
    """The cell paths that get a `pipeline_stage`, in order."""
    num_layers = len(model.model.layers)
    parts = ["model.tok_embeddings", *(f"model.layers.{i}" for i in range(num_layers)), "model.norm_out"]
    return parts if model.tie_embeddings else parts + ["lm_head"]


def num_layers_in(names: Iterable[str]) -> int:
    """The decoder layer count of a checkpoint, from its tensor names."""
    return 1 + max(int(m.group(1)) for m in map(_LAYER.match, names) if m)
