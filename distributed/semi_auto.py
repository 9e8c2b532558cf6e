"""Tensor / pipeline / sequence parallelism and optimizer sharding: MindSpore's SEMI_AUTO_PARALLEL, applied to
the plain model from outside (the model file holds no parallel code). Used when base.schema.is_sharded.

    shard_model(model, cfg)        the family's plan (models/<family>/plan.py): shard() strategies on its
                                   primitives (context parallel: the sequence split over cp, ring attention's
                                   prim attributes), pipeline_stage (and pipeline_segment: the virtual stage
                                   under vp) on its parts
    parallel_step(step, cfg, ...)  trainer/step.py's ShardedTrainStep (forward, backward, gradient reduction,
                                   clipping and AdamW in one graph) under
                                   `AutoParallel` with .pipeline(stages, interleave=vp > 1) and .hsdp()
                                   (optimizer sharding over dp; optimizer_level level3 under zero3: the
                                   gradients too), tensor-parallel overlap through MindSpore's
                                   parallel_speed_up_json (Ascend), and the per-rank strategy file MindSpore
                                   writes when it compiles
    parallel_evaluation(loss, cfg)   the loss cell's forward under the same layout: evaluation on the slices
    batch_strategy / feed          the dataset strategy: a batch's rows over dp, the same rows for a tp group
    save_rank_slices / load_rank_slices   checkpoints as per-rank slices + strategy (sharded_checkpoint.py)
    barrier()                      every rank of the run (all nodes) waits for the others

Only Ascend and GPU compile sharded graphs; on CPU MindSpore stops at its first parallel pass with
"Invalid communication backend: CPU for semi_auto_parallel/auto_parallel mode" — tests/test_semi_auto.py runs
this path under msrun on CPU up to exactly that point. The first sharded step has not been executed here.
"""
import json
import os

import mindspore as ms
from mindspore import nn
from mindspore.parallel import merge_pipeline_strategys
from mindspore.parallel.auto_parallel import AutoParallel
from omegaconf import DictConfig

from base.checkpoint import CheckpointError
from base.schema import ulysses_degree
from distributed.sharded_checkpoint import SLICE, STRATEGY
from models import plan_of

# parallel.tp_overlap: the weight-gradient matmuls overlap their collectives, and matmuls are interleaved with the
# tensor-parallel communication (keys of MindSpore's parallel_speed_up_json, mindspore/context.py)
TP_OVERLAP = {"matmul_grad_comm_overlap": True, "interleaved_matmul_comm": True}


def shard_model(model: nn.Cell, cfg: DictConfig) -> None:
    p, plan = cfg.parallel, plan_of(cfg.model.family)
    apply_tensor_parallel(model, plan, p.dp, p.tp, p.sequence_parallel, p.cp, p.cp_algo,
                          cfg.device.devices_per_node, p.ep)
    if p.pp > 1:
        assign_stages(model, plan, p.pp, p.vp)


def apply_tensor_parallel(model: nn.Cell, plan, dp: int, tp: int, sequence_parallel: bool = False, cp: int = 1,
                          cp_algo: str = "ring", devices_per_node: int = 8, ep: int = 1) -> dict:
    """Shard the model's primitives as the family's plan says (call under SEMI_AUTO_PARALLEL; `ep`: the experts
    over ep of the dp ranks), with the output strategies the plan gives (sequence parallelism's reduce-scatters);
    returns the input strategies applied, `<cell path>.<primitive>` -> one tuple (or MindSpore Layout) per input.
    Context parallelism: the plan's context_parallel_attributes (ring attention) set on the primitives too."""
    cells = dict(model.cells_and_names())
    ulysses = ulysses_degree(cp, cp_algo, tp, devices_per_node)
    strategies = plan.tensor_parallel_strategies(model, dp, tp, sequence_parallel, cp, ulysses, ep)
    outputs = plan.output_strategies(model, dp, tp, sequence_parallel, cp)
    for path, strategy in strategies.items():
        owner, _, primitive = path.rpartition(".")
        getattr(cells[owner], primitive).shard(strategy, out_strategy=outputs.get(path))
    for path, attributes in plan.context_parallel_attributes(model, cp, ulysses).items():
        owner, _, primitive = path.rpartition(".")
        for name, value in attributes.items():
            getattr(cells[owner], primitive).add_prim_attr(name, value)
    return strategies


def assign_stages(model: nn.Cell, plan, pp: int, vp: int = 1) -> dict:
    """Set `pipeline_stage` on the parts the family's plan lists, and under vp virtual stages their
    `pipeline_segment`: the layers cut into pp x vp chunks, chunk c on stage c % pp, segment c // pp (MindSpore's
    interleaved pipeline); returns cell path -> stage."""
    parts = plan.pipeline_parts(model)
    num_layers = len(model.layers())
    chunks = {path: plan.stage_of(path, num_layers, pp * vp) for path in parts}
    cells = dict(model.cells_and_names())
    for path, chunk in chunks.items():
        cells[path].pipeline_stage = chunk % pp
        if vp > 1:
            cells[path].pipeline_segment = chunk // pp
    return {path: chunk % pp for path, chunk in chunks.items()}


def parallel_step(step: nn.Cell, cfg: DictConfig, run_dir: str, rank: int) -> AutoParallel:
    """Wrap the step for semi-auto compilation; MindSpore writes this rank's strategy file on compile. The
    dataset strategy is set by `feed` before the first call."""
    p = cfg.parallel
    compiled = AutoParallel(step, parallel_mode="semi_auto")
    if p.pp > 1:
        compiled.pipeline(stages=p.pp, interleave=p.vp > 1)
    if p.optimizer_shard:
        compiled.hsdp(optimizer_level="level3" if p.zero3 else "level1")
    if p.tp_overlap:  # Ascend only (base/validate.py): MindSpore's matmul/communication overlap passes
        speed_up = os.path.join(run_dir, "parallel_speed_up.json")
        with open(speed_up, "w") as f:
            json.dump(TP_OVERLAP, f)
        ms.set_context(ascend_config={"parallel_speed_up_json_path": speed_up})
    compiled.save_param_strategy_file(os.path.join(run_dir, "strategy", f"rank_{rank}.ckpt"))
    return compiled


def parallel_evaluation(forward: nn.Cell, cfg: DictConfig) -> AutoParallel:
    """The loss cell's forward under the training step's layout (the same strategies on the same primitives, the
    same stages), so evaluation runs on the slices each rank holds. With pp > 1 `forward` is the loss cell in
    trainer/step.py's PipelinedLoss, and the last stage's outputs are broadcast to every stage (MindSpore's
    pipeline inference)."""
    p = cfg.parallel
    compiled = AutoParallel(forward, parallel_mode="semi_auto")
    if p.pp > 1:
        compiled.pipeline(stages=p.pp, output_broadcast=True)
    if p.optimizer_shard:
        compiled.hsdp()
    return compiled


def batch_strategy(inputs: tuple, dp: int) -> tuple:
    """The dataset strategy of a batch's columns: each split by rows over dp and whole otherwise. Every rank of a
    tensor-parallel group is fed the same rows (trainer/loop.py reads the data by dp rank); MindSpore's default
    ("data_parallel") would take each rank's rows as a slice over all dp x tp devices of the stage, a graph batch
    tp times larger made of duplicates."""
    return tuple((dp,) + (1,) * (len(column.shape) - 1) for column in inputs)


def feed(compiled: AutoParallel, inputs: tuple, dp: int) -> None:
    """Set `compiled`'s dataset strategy for batches shaped like `inputs` (before its first call)."""
    compiled.dataset_strategy(batch_strategy(inputs, dp))


def save_rank_slices(step_dir: str, step: nn.Cell, rank: int, run_dir: str) -> None:
    """Write the weight and AdamW slices this rank holds to step_dir/rank_<r>/checkpoint.safetensors; rank 0 also
    merges the per-rank strategy files of the compile into step_dir/strategy.ckpt (then the caller adds
    state.json). The result is the layout of distributed/sharded_checkpoint.py: `python -m distributed.reshard
    merge <step_dir> OUT` makes it whole."""
    final = os.path.join(step_dir, f"rank_{rank}")
    tmp = f"{final}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    # params + moments, each as the slice this rank holds: MindSpore's default (integrated_save=True) all-gathers
    # tensor-parallel and optimizer-sharded parameters and writes them whole, and refuses under pipeline parallelism
    ms.save_checkpoint(step.update.optimizer, os.path.join(tmp, SLICE), integrated_save=False, format="safetensors")
    os.replace(tmp, final)
    if rank == 0:
        merge_pipeline_strategys(os.path.join(run_dir, "strategy"), os.path.join(step_dir, STRATEGY))


def barrier() -> None:
    """Wait until every rank of the run has got here (the whole world: all nodes)."""
    from mindspore.communication.comm_func import barrier as world_barrier

    world_barrier()


def load_rank_slices(step_dir: str, compiled: AutoParallel, rank: int, example_inputs: tuple) -> None:
    """Resume a sharded run with the same layout: compile the step first (MindSpore then holds each parameter
    as this rank's slice), then load rank_<r>/checkpoint.safetensors into it. Another layout: reshard first
    (python -m distributed.reshard reshard)."""
    file = os.path.join(step_dir, f"rank_{rank}", SLICE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing; the checkpoint is incomplete or of another layout (reshard it: "
                              "python -m distributed.reshard reshard)")
    compiled.compile(*example_inputs)
    ms.load_param_into_net(compiled.network.update.optimizer, ms.load_checkpoint(file, format="safetensors"),
                           strict_load=True)
