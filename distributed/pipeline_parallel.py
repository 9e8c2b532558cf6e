"""Pipeline parallelism: each decoder layer gets a `pipeline_stage` (MindSpore's `mindspore.parallel.nn.Pipeline`
wrapper then splits every step's batch into micro-batches, 1F1B). Stages own contiguous, equal runs of layers (conf/validate.py
requires pp | num_layers); the embedding sits on the first stage, the final norm and LM head on the last.
Like tensor parallelism, this compiles only for Ascend/GPU; on CPU the assignment is built and checked.
"""
from typing import Dict

from mindspore import nn


def assign_stages(model: nn.Cell, pp: int) -> Dict[str, int]:
    """Set `pipeline_stage` on the model's top-level parts; returns cell path -> stage."""
    layers = model.model.layers
    per_stage = len(layers) // pp
    stages = {"model.tok_embeddings": 0, "model.norm_out": pp - 1}
    stages.update({f"model.layers.{i}": i // per_stage for i in range(len(layers))})
    if not model.tie_embeddings:
        stages["lm_head"] = pp - 1
    cells = dict(model.cells_and_names())
    for path, stage in stages.items():
        cells[path].pipeline_stage = stage
    return stages

