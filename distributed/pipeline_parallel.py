"""Pipeline parallelism: each decoder layer gets a `pipeline_stage` (MindSpore's `mindspore.parallel.nn.Pipeline`
wrapper then splits every step's batch into micro-batches, 1F1B). Stages own contiguous, equal runs of layers (conf/validate.py
requires pp | num_layers); the embedding sits on the first stage, the final norm and LM head on the last.
Like tensor parallelism, this compiles only for Ascend/GPU; on CPU the assignment is built and checked.
"""
from typing import Dict, Optional

from mindspore import nn


def stage_of(path: str, num_layers: int, pp: int) -> Optional[int]:
    """Stage of a cell or parameter path of the native Llama; None for what no stage owns (a step counter)."""
    if path.startswith("model.tok_embeddings"):
        return 0
    if path.startswith("model.layers."):
        return int(path.split(".")[2]) // (num_layers // pp)
    if path.startswith(("model.norm_out", "lm_head")):
        return pp - 1
    return None


def assign_stages(model: nn.Cell, pp: int) -> Dict[str, int]:
    """Set `pipeline_stage` on the model's top-level parts; returns cell path -> stage."""
    num_layers = len(model.model.layers)
    parts = ["model.tok_embeddings", *(f"model.layers.{i}" for i in range(num_layers)), "model.norm_out"]
    if not model.tie_embeddings:
        parts.append("lm_head")
    stages = {path: stage_of(path, num_layers, pp) for path in parts}
    cells = dict(model.cells_and_names())
    for path, stage in stages.items():
        cells[path].pipeline_stage = stage
    return stages
