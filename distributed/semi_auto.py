"""Tensor / pipeline / sequence parallelism and optimizer sharding: MindSpore's SEMI_AUTO_PARALLEL, applied to
the plain model from outside (the model file holds no parallel code). Used when conf.schema.is_sharded.

    shard_model(model, cfg)        shard() strategies from tensor_parallel.py, pipeline_stage per layer
    ShardedTrainStep               forward, backward, gradient reduction, clipping and AdamW as one graph, as the
                                   pipeline pass needs; with pp > 1 the batch is split into
                                   parallel.micro_batches micro-batches (1F1B) by `Pipeline`, and
                                   `PipelineGradReducer` accumulates their gradients (they are the accumulation:
                                   validation requires trainer.grad_accum=1)
    parallel_step(step, cfg, ...)  `AutoParallel` with .pipeline(stages) and .hsdp() (optimizer sharding over dp),
                                   and the per-rank strategy file MindSpore writes when it compiles
    save_rank_slices / load_rank_slices   checkpoints as per-rank slices + strategy (sharded_checkpoint.py)

Only Ascend and GPU compile sharded graphs; on CPU MindSpore stops at its first parallel pass with
"Invalid communication backend: CPU for semi_auto_parallel/auto_parallel mode" — tests/test_semi_auto.py runs
this path under msrun on CPU up to exactly that point. The first sharded step has not been executed here.
"""
import os

import mindspore as ms
from mindspore import nn
from mindspore.parallel import merge_pipeline_strategys
from mindspore.parallel.auto_parallel import AutoParallel
from mindspore.parallel.nn import Pipeline, PipelineGradReducer
from omegaconf import DictConfig

from distributed.pipeline_parallel import assign_stages
from distributed.sharded_checkpoint import SLICE, STRATEGY
from distributed.tensor_parallel import apply_tensor_parallel
from trainer.checkpoint import CheckpointError
from trainer.step import ClipAndUpdate


def shard_model(model: nn.Cell, cfg: DictConfig) -> None:
    p = cfg.parallel
    apply_tensor_parallel(model, p.dp, p.tp, p.sequence_parallel)
    if p.pp > 1:
        assign_stages(model, p.pp)


class ShardedTrainStep(nn.Cell):
    """One optimizer step in one graph: (loss, grad_norm, finite, lr) = step(input_ids, labels, loss_scale)."""

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Optimizer, clip_grad_norm: float, pp: int,
                 micro_batches: int, optimizer_shard: bool):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.net = Pipeline(loss_net, micro_batches) if pp > 1 else loss_net
        self.update = ClipAndUpdate(optimizer, clip_grad_norm)
        self.value_and_grad = ms.value_and_grad(self.scaled_loss, None, optimizer.parameters)
        self.pipelined = pp > 1
        self.allow = ms.Tensor(True)
        self.reducer = PipelineGradReducer(optimizer.parameters, opt_shard=optimizer_shard) if pp > 1 else None

    def scaled_loss(self, input_ids, labels, loss_scale):
        return self.net(input_ids, labels) * loss_scale

    def construct(self, input_ids, labels, loss_scale):
        scaled, grads = self.value_and_grad(input_ids, labels, loss_scale)
        if self.pipelined:
            grads = self.reducer(grads)
        norm, finite, lr = self.update([g / loss_scale for g in grads], self.allow)
        return scaled / loss_scale, norm, finite, lr


def parallel_step(step: ShardedTrainStep, cfg: DictConfig, run_dir: str, rank: int) -> AutoParallel:
    """Wrap the step for semi-auto compilation; MindSpore writes this rank's strategy file on compile."""
    p = cfg.parallel
    compiled = AutoParallel(step, parallel_mode="semi_auto")
    if p.pp > 1:
        compiled.pipeline(stages=p.pp)
    if p.optimizer_shard:
        compiled.hsdp()
    compiled.save_param_strategy_file(os.path.join(run_dir, "strategy", f"rank_{rank}.ckpt"))
    return compiled


def save_rank_slices(step_dir: str, step: ShardedTrainStep, rank: int, run_dir: str) -> None:
    """Write the weight and AdamW slices this rank holds to step_dir/rank_<r>/checkpoint.safetensors; rank 0 also
    merges the per-rank strategy files of the compile into step_dir/strategy.ckpt (then the caller adds
    state.json). The result is the layout of distributed/sharded_checkpoint.py: `python -m distributed.reshard
    merge <step_dir> OUT` makes it whole."""
    final = os.path.join(step_dir, f"rank_{rank}")
    tmp = f"{final}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    ms.save_checkpoint(step.update.optimizer, os.path.join(tmp, SLICE), format="safetensors")  # params + moments
    os.replace(tmp, final)
    if rank == 0:
        merge_pipeline_strategys(os.path.join(run_dir, "strategy"), os.path.join(step_dir, STRATEGY))


def load_rank_slices(step_dir: str, compiled: AutoParallel, rank: int, example_batch: ms.Tensor) -> None:
    """Resume a sharded run with the same layout: compile the step first (MindSpore then holds each parameter
    as this rank's slice), then load rank_<r>/checkpoint.safetensors into it. Another layout: reshard first
    (python -m distributed.reshard reshard)."""
    file = os.path.join(step_dir, f"rank_{rank}", SLICE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing; the checkpoint is incomplete or of another layout (reshard it: "
                              "python -m distributed.reshard reshard)")
    compiled.compile(example_batch, example_batch, ms.Tensor(1.0, ms.float32))
    ms.load_param_into_net(compiled.network.update.optimizer, ms.load_checkpoint(file, format="safetensors"),
                           strict_load=True)
