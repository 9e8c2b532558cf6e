"""Checkpoints under tensor/pipeline layouts: one slice per rank plus MindSpore strategy files, and the way back.

    <dir>/rank_<r>/checkpoint.safetensors  what rank r holds (weights and AdamW state): its stage's, split over tp
    <dir>/strategy/stage_<s>.ckpt          MindSpore's strategy file for stage s (node_strategy.proto ParallelStrategyMap)
    <dir>/strategy.ckpt                    the stages merged by `mindspore.parallel.merge_pipeline_strategys`

A parameter's layout in the strategy file: dev_matrix [dp, tp] (the ranks of one stage, row-major, so the
rank in the stage is dp_rank * tp + tp_rank as in planner/layout.py) and a tensor_map naming, per tensor
dimension, the dev-matrix axis it is split over counted from the right (0 = tp) or -1. A mixture of experts'
routed expert weights under expert parallelism (ep > 1) have dev_matrix [dp / ep, ep, tp], their expert dimension
over the ep axis (1): the device matrix models/moe/plan.py lays the batched matmuls on, so dp rank d holds the
(d mod ep)-th slice of the experts, and each group of ep consecutive dp ranks all of them (planner/layout.py
ep_groups).
Each stage file also carries one strategy item per parameter with its split and stage, as MindFormers' own strategy
writer does.
AdamW moments (`adam_m.<param>`, `adam_v.<param>`) are laid out like their parameter; the step counter is
replicated on every stage.

Optimizer sharding (parallel.optimizer_shard: MindSpore's parallel optimizer, `AutoParallel.hsdp()` at its
defaults) splits each slice once more, along its first dimension, over the ranks that would otherwise hold the
same slice: the dp group of a tensor-parallel slice (opt_weight_shard_step tp, size dp), the whole stage for a
replicated tensor (step 1, size dp x tp). A tensor is left whole where that dimension does not divide, or where
it is under the threshold of 64 KB (MindSpore's `parallel_optimizer_threshold`, on the parameter's bytes);
`optimizer_shard` below is that rule, and what `split`/`reshard --optimizer-shard` write for a run to resume.

Merging and resharding are MindSpore's `transform_checkpoints` reading these files, so what it accepts here
it accepts from a real sharded run. `python -m distributed.reshard` is the command line.
"""
import os
import re
import tempfile
from typing import Dict, List, Tuple

import numpy as np

import mindspore as ms
from mindspore.parallel import merge_pipeline_strategys, transform_checkpoints
from mindspore.train.node_strategy_pb2 import ParallelStrategyMap

from base.checkpoint import CheckpointError
from planner.layout import Layout

SLICE, STRATEGY, PREFIX = "checkpoint.safetensors", "strategy.ckpt", "model"
OPTIMIZER_STATE = re.compile(r"^adam_[mv]\.")


def layout_for(names, dp: int, tp: int, pp: int, plan, ep: int = 1) -> Layout:
    """The layout of a checkpoint with these tensor names (the family's plan reads the layer count from them)."""
    layers = plan.num_layers_in(OPTIMIZER_STATE.sub("", n) for n in names)
    if layers % pp:
        raise CheckpointError(f"--pp: pp={pp} does not divide the checkpoint's {layers} layers; choose a divisor")
    return Layout(dp=dp, tp=tp, pp=pp, num_layers=layers, ep=ep)


def tensor_layout(name: str, ndim: int, layout: Layout, plan) -> Tuple[Tuple[int, ...], Tuple[int, ...], List[int]]:
    """(how tp splits each dimension, how ep splits each: a routed expert weight's expert dimension, the pipeline
    stages that hold it) for a checkpoint entry, as the model family's plan (models/<family>/plan.py) lays it out
    (its `weight_split(name, ndim, tp, ep)` where ep > 1: only a family with experts takes one)."""
    param = OPTIMIZER_STATE.sub("", name)
    split = plan.weight_split(param, ndim, layout.tp) if ndim else ()
    experts = plan.weight_split(param, ndim, 1, layout.ep) if ndim and layout.ep > 1 else (1,) * ndim
    stage = plan.stage_of(param, layout.num_layers, layout.pp)
    return split, experts, list(range(layout.pp)) if stage is None else [stage]


OPTIMIZER_SHARD_THRESHOLD_KB = 64  # MindSpore's default parallel_optimizer_threshold (AutoParallel.hsdp)


def optimizer_shard(shape: Tuple[int, ...], split: Tuple[int, ...], layout: Layout) -> Tuple[int, int]:
    """(ways, step) in which optimizer sharding splits a tensor of full `shape` that tp splits as `split`: the
    ranks holding the same slice (spaced `step` apart in the stage) each keep one of `ways` pieces of its first
    dimension; (1, 0) where it stays whole (module docstring)."""
    split_over_tp = any(ways > 1 for ways in split)
    ways = layout.dp if split_over_tp else layout.dp * layout.tp
    first = shape[0] // split[0] if shape else 0
    if ways == 1 or not shape or first % ways or 4 * int(np.prod(shape)) < OPTIMIZER_SHARD_THRESHOLD_KB * 1024:
        return 1, 0
    return ways, layout.tp if split_over_tp else 1


def strategy_map(shapes: Dict[str, Tuple[int, ...]], layout: Layout, stage: int, plan,
                 sharded_optimizer: bool = False) -> ParallelStrategyMap:
    """Stage `stage`'s strategy file content for tensors of the given full shapes (`sharded_optimizer`: with
    optimizer sharding's fields)."""
    strategy = ParallelStrategyMap(current_stage=stage)
    for name, shape in shapes.items():
        split, experts, stages = tensor_layout(name, len(shape), layout, plan)
        if stage not in stages:
            continue
        ways, step = optimizer_shard(shape, split, layout) if sharded_optimizer else (1, 0)
        item = strategy.parallel_strategy_item.add(node_name=name)
        item.parallel_strategys.stage = stage
        item.parallel_strategys.parallel_strategy.add().dim.extend(t * e for t, e in zip(split, experts))
        layouts = strategy.parallel_layout_item.add(param_name=name).parallel_layouts
        if any(e > 1 for e in experts):  # the experts over ep (module docstring)
            layouts.dev_matrix.add().dim.extend([layout.dp // layout.ep, layout.ep, layout.tp])
            layouts.tensor_map.add().dim.extend([1 if e > 1 else 0 if t > 1 else -1 for t, e in zip(split, experts)])
        else:
            layouts.dev_matrix.add().dim.extend([layout.dp, layout.tp])
            layouts.tensor_map.add().dim.extend([0 if ways > 1 else -1 for ways in split])
        layouts.param_split_shape.add()
        layouts.indices_offset.add()
        layouts.field, layouts.opt_weight_shard_step, layouts.opt_weight_shard_size = 0, step, 0 if ways == 1 else ways
    return strategy


def write_strategy(directory: str, shapes: Dict[str, Tuple[int, ...]], layout: Layout, plan,
                   sharded_optimizer: bool = False) -> str:
    """Write one strategy file per stage and their merge; returns the merged file's path."""
    stage_dir = os.path.join(directory, "strategy")
    os.makedirs(stage_dir, exist_ok=True)
    for stage in range(layout.pp):
        with open(os.path.join(stage_dir, f"stage_{stage}.ckpt"), "wb") as f:
            f.write(strategy_map(shapes, layout, stage, plan, sharded_optimizer).SerializeToString())
    merged = os.path.join(directory, STRATEGY)
    merge_pipeline_strategys(stage_dir, merged)
    return merged


def rank_slice(tensors: Dict[str, np.ndarray], layout: Layout, rank: int, plan,
               sharded_optimizer: bool = False) -> Dict[str, np.ndarray]:
    """The part of full `tensors` that `rank` holds (`sharded_optimizer`: under optimizer sharding)."""
    where = layout.coords(rank)
    expert_slice = where.dp % layout.ep  # (module docstring)
    out = {}
    for name, array in tensors.items():
        split, experts, stages = tensor_layout(name, array.ndim, layout, plan)
        if where.pp not in stages:
            continue
        ways, step = optimizer_shard(array.shape, split, layout) if sharded_optimizer else (1, 0)
        for axis, (tp_ways, ep_ways) in enumerate(zip(split, experts)):
            if array.shape[axis] % (tp_ways * ep_ways):
                raise CheckpointError(f"{name}: dimension {axis} (size {array.shape[axis]}) does not split "
                                      f"{tp_ways * ep_ways} ways; tp must divide the heads, KV heads, ffn width and "
                                      f"vocabulary, ep the experts")
            if ep_ways > 1:
                array = np.split(array, ep_ways, axis=axis)[expert_slice]
            if tp_ways > 1:
                array = np.split(array, tp_ways, axis=axis)[where.tp]
        if ways > 1:  # the rank's place among those holding this slice: its dp rank, or its rank in the stage
            array = np.split(array, ways)[where.dp if step == layout.tp else where.dp * layout.tp + where.tp]
        out[name] = array
    return out


def save_tensors(tensors: Dict[str, np.ndarray], path: str, fmt: str = "safetensors") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(a)} for n, a in tensors.items()], path, format=fmt)


def load_tensors(path: str, fmt: str = "safetensors") -> Dict[str, np.ndarray]:
    return {name: param.asnumpy() for name, param in ms.load_checkpoint(path, format=fmt).items()}


def split_checkpoint(tensors: Dict[str, np.ndarray], layout: Layout, out_dir: str, plan,
                     sharded_optimizer: bool = False) -> None:
    """Full tensors -> <out_dir>/rank_<r>/checkpoint.safetensors for every rank, plus the strategy files."""
    for rank in range(layout.world_size):
        save_tensors(rank_slice(tensors, layout, rank, plan, sharded_optimizer),
                     os.path.join(out_dir, f"rank_{rank}", SLICE))
    write_strategy(out_dir, {n: a.shape for n, a in tensors.items()}, layout, plan, sharded_optimizer)


def _check_sharded(src_dir: str) -> str:
    strategy = os.path.join(src_dir, STRATEGY)
    if not os.path.isfile(strategy) or not any(n.startswith("rank_") for n in os.listdir(src_dir)):
        raise CheckpointError(f"{src_dir}: not a sharded checkpoint (needs rank_<r>/ directories and "
                                f"{STRATEGY}); write one with `python -m distributed.reshard split`")
    return strategy


def merge_checkpoint(src_dir: str) -> Dict[str, np.ndarray]:
    """Per-rank slices + strategy under `src_dir` -> the full tensors."""
    strategy = _check_sharded(src_dir)
    with tempfile.TemporaryDirectory() as tmp:
        transform_checkpoints(src_dir, tmp, PREFIX, strategy, None, output_format="safetensors")
        return load_tensors(os.path.join(tmp, "rank_0", f"{PREFIX}0.safetensors"))


def reshard_checkpoint(src_dir: str, dp: int, tp: int, pp: int, out_dir: str, plan,
                       sharded_optimizer: bool = False, ep: int = 1) -> Layout:
    """Per-rank slices under `src_dir` -> those of layout dp x tp x pp (`ep`: a mixture of experts' experts over
    ep of the dp ranks; `sharded_optimizer`: with optimizer sharding) in `out_dir`, by transform_checkpoints.

    The slices go through MindSpore's .ckpt format: in MindSpore 2.9 the safetensors path of
    transform_checkpoints scrambles tensors split on a non-leading dimension (row-parallel wo, w2) when the
    target is sharded too (merging to full is right; measured here); its .ckpt path is right for both.
    """
    strategy = _check_sharded(src_dir)
    src_layouts = {name.split("-", 1)[1]: layouts  # merged files prefix names with "<stage>-"
                   for name, layouts in ms.parallel.build_searched_strategy(strategy).items()}
    layout = layout_for(src_layouts, dp, tp, pp, plan, ep)
    shapes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rank_dir in sorted(n for n in os.listdir(src_dir) if n.startswith("rank_")):
            tensors = load_tensors(os.path.join(src_dir, rank_dir, SLICE))
            save_tensors(tensors, os.path.join(tmp, "src", rank_dir, f"{PREFIX}.ckpt"), "ckpt")
            for name, array in tensors.items():  # full shape = slice shape x the source split
                source = src_layouts[name]
                dev_matrix, tensor_map = source.dev_matrix[0].dim, source.tensor_map[0].dim
                shape = [n * (dev_matrix[-1 - m] if m >= 0 else 1) for n, m in zip(array.shape, tensor_map)]
                if shape and source.opt_weight_shard_size > 1:  # the source's optimizer shards
                    shape[0] *= source.opt_weight_shard_size
                shapes[name] = tuple(shape)
        transform_checkpoints(os.path.join(tmp, "src"), os.path.join(tmp, "out"), PREFIX, strategy,
                              write_strategy(out_dir, shapes, layout, plan, sharded_optimizer))
        for rank in range(layout.world_size):  # MindSpore names its output <prefix><rank>.ckpt
            tensors = load_tensors(os.path.join(tmp, "out", f"rank_{rank}", f"{PREFIX}{rank}.ckpt"), "ckpt")
            save_tensors(tensors, os.path.join(out_dir, f"rank_{rank}", SLICE))
    return layout
