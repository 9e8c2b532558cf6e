"""The tensor/pipeline training path's pieces, compiled and run where CPU can: in stand-alone graph mode.

MindSpore's parallel passes (strategies, pipeline stages, the gradient accumulation of a pipeline, optimizer
sharding) run only on Ascend/GPU. What does not need them compiles here with the project's own loss cells and a
tiny Llama, and its errors reproduce: the pipeline-wrapped step (PipelinedLoss around a loss cell that returns a
tuple), the pipeline gradient reducer, the step's micro-batch arithmetic, the clipping norm's marks for the
parallel pass, the per-rank save. What the parallel pass would do with them is checked as data: the dataset
strategy, the evaluation graph's layout, the stage whose loss is reported.
"""
import glob
import os
from contextlib import contextmanager

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from conftest import compose_cfg
from models import build_model
from objectives import objective as objective_plugin
from trainer.module import ShardedModule, last_stage_values, loss_cell
from trainer.optimizer import build_optimizer
from trainer.step import PipelinedLoss, ShardedTrainStep, TrainStep

SEQ = 16


def tiny(objective: str = "clm", sharded: bool = True):
    """(model, loss cell, optimizer, cfg) of a one-layer tiny Llama, built as a sharded run builds it (or as one
    device does), with an lr that moves the weights on the first step. The weights are the one-device build's
    (seed 0) in both: a sharded build leaves them to the compile, which initialises them at random. (One layer: in
    stand-alone graph mode no pipeline stage is cut, so what is checked holds at any depth.)"""
    cfg = compose_cfg("model=tiny", f"data.seq_len={SEQ}", "model.num_layers=1", "optim.warmup_steps=0",
                      f"objective={objective}")
    model = build_model(cfg.model, SEQ, "fp32", "CPU", 0, sharded=sharded)
    if sharded:
        reference = build_model(cfg.model, SEQ, "fp32", "CPU", 0)
        ms.load_param_into_net(model, {p.name: p for p in reference.get_parameters()}, strict_load=True)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, 10, "CPU", sharded=sharded)
    return model, loss_cell(objective_plugin(objective).Objective(cfg.objective), model), optimizer, cfg


def batch(rows: int = 4, seed: int = 0):
    ids = np.random.default_rng(seed).integers(0, 200, (rows, SEQ + 1)).astype(np.int32)
    return ids, ids


def sft_batch(rows: int = 4):
    """Two packed samples a row, every token after a sample's first labelled (so each micro-batch has the same
    loss-token count and the mean of micro-batch means is the batch mean)."""
    ids, _ = batch(rows, 1)
    half = (SEQ + 1) // 2
    positions = np.concatenate([np.arange(half), np.arange(SEQ + 1 - half)])[None].repeat(rows, 0).astype(np.int32)
    segments = (np.arange(SEQ + 1) >= half).astype(np.int32)[None].repeat(rows, 0)
    labels = np.where(positions == 0, -100, ids).astype(np.int32)
    return ids, labels, positions, segments


@contextmanager
def eager():
    """PyNative mode for a reference computed once: its own graph would cost a compile and test nothing here."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        yield
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def weights(model) -> dict:
    return {p.name: p.asnumpy().copy() for p in model.trainable_params()}


@pytest.mark.parametrize("objective, make", [("clm", batch), ("sft", sft_batch)])
def test_the_pipeline_step_is_the_mean_of_its_micro_batches(objective, make):
    """pp=2 with 2 micro-batches (optimizer sharding on: the branch whose gradients come straight out of the
    backward) against the one-device step on the same batch: equal loss, metrics, clipping norm and updated weights.
    MindSpore's Pipeline fails here ("Failed calling Add with input=Tuple[Tensor]": the loss cells return tuples);
    summing the micro-batches instead of averaging them doubles the loss and the norm."""
    model, net, optimizer, _ = tiny(objective)
    piped = ShardedTrainStep(net, optimizer, 1.0, pp=2, micro_batches=2, optimizer_shard=True)
    *outs, norm, finite, lr = piped(*map(Tensor, make()))
    ref_model, ref_net, ref_optimizer, _ = tiny(objective, sharded=False)
    initial = weights(ref_model)  # (both models' before their step)
    with eager():
        ref = TrainStep(ref_net, ref_optimizer, 1.0)(Tensor(1.0, ms.float32), Tensor(np.float32(np.inf)),
                                                      *map(Tensor, make()))
    *ref_outs, ref_norm, ref_finite, ref_lr = ref
    assert len(outs) == len(ref_outs) == (1 if objective == "clm" else 2)
    np.testing.assert_allclose([o.asnumpy() for o in outs], [o.asnumpy() for o in ref_outs], rtol=1e-5)
    np.testing.assert_allclose(norm.asnumpy(), ref_norm.asnumpy(), rtol=1e-5)
    assert bool(finite.asnumpy()) and float(lr.asnumpy()) > 0
    ours, theirs, step = weights(model), weights(ref_model), float(lr.asnumpy())
    assert max(np.abs(theirs[k] - initial[k]).max() for k in theirs) == pytest.approx(step, rel=0.01)  # AdamW's first
    assert max(np.abs(ours[k] - theirs[k]).max() for k in theirs) < 0.1 * step  # step moves a weight by about lr


def test_the_pipeline_reducer_reads_and_zeroes_the_accumulated_gradients():
    """Without optimizer sharding the gradients are the `accu_grads` buffers MindSpore's pipeline pass fills
    (it does not run here: they are filled by hand). MindSpore 2.9's PipelineGradReducer fails to compile in this
    branch (NameError: 'grads'); ours reads the buffers into the clipping norm and the update, then zeroes them."""
    model, net, optimizer, _ = tiny()
    step = ShardedTrainStep(net, optimizer, 0.0, pp=2, micro_batches=2, optimizer_shard=False)
    filled = [np.full(p.shape, 0.01 * (i + 1), np.float32) for i, p in enumerate(step.reducer.accu_grads)]
    for buffer, value in zip(step.reducer.accu_grads, filled):
        buffer.set_data(Tensor(value))
    *_, norm, finite, _ = step(*map(Tensor, batch()))
    np.testing.assert_allclose(norm.asnumpy(), np.sqrt(sum((v.astype(np.float64) ** 2).sum() for v in filled)),
                               rtol=1e-4)
    assert all(not buffer.asnumpy().any() for buffer in step.reducer.accu_grads)


def test_the_clipping_norm_is_marked_for_the_parallel_pass(tmp_path):
    """Every gradient's square sum reaches MindSpore's parallel pass through an ExpandDims marked grad_scale, the
    mark for which it all-reduces the sum over the tensor's shards and the pipeline stages (mindspore's
    clip_func.py, MindFormers' ClipGradNorm); unmarked, each rank would clip by its own shard's norm. Read from
    the graph as the pass receives it, and the norm's value by hand."""
    from mindspore import nn, ops

    model, _, optimizer, _ = tiny()

    class Norm(nn.Cell):
        def __init__(self):
            super().__init__()
            self.optimizer = optimizer

        def construct(self, *grads):
            return ops.sqrt(ops.addn(self.optimizer.square_sums(grads)))

    grads = [np.full(p.shape, 0.5, np.float32) for p in model.trainable_params()]
    ms.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    try:
        norm = Norm()(*map(Tensor, grads))
    finally:
        ms.set_context(save_graphs=0)
    np.testing.assert_allclose(norm.asnumpy(), [0.5 * np.sqrt(sum(g.size for g in grads))], rtol=1e-5)
    (before_pass,) = glob.glob(os.path.join(tmp_path, "*_pre_auto_parallel_*.ir"))
    with open(before_pass, encoding="utf-8") as f:
        expand = [line for line in f if "PrimFunc_ExpandDims(" in line]
    assert expand and all("grad_scale: Bool(1)" in line for line in expand)  # (one per gradient shape: HyperMap)


def test_the_reported_loss_is_the_last_stages():
    """Only the last pipeline stage runs the loss cell: 8 ranks of dp2 x tp2 x pp2, the first stage's outputs
    garbage, every rank gets the last stage's (MindFormers' loss callback reads that stage for the same reason)."""
    world = [([123.0, -5.0] if rank < 4 else [2.5, 0.75]) for rank in range(8)]
    on_last = [rank >= 4 for rank in range(8)]

    def world_sum(array):  # what each rank contributes, summed as the all-reduce would
        return sum(np.array(values + [1.0], np.float32) * float(last) for values, last in zip(world, on_last))

    for rank in range(8):
        assert last_stage_values(world[rank], on_last[rank], pp=2, all_reduce=world_sum) == [2.5, 0.75]
    assert last_stage_values([1.0, 2.0], True, pp=1) == [1.0, 2.0]


def test_the_sharded_module_feeds_each_graph_by_dp_and_evaluates_through_the_layout(monkeypatch):
    """The data: every input split by rows over dp only (a tp group reads the same rows; MindSpore's default would
    split them over dp x tp). Evaluation: the loss cell's forward in PipelinedLoss under the same pipeline, its
    last stage's outputs broadcast, and its sums over micro-batches divided by their count; never the bare loss
    cell, which would run the whole model on one device. The weights: none materialised before the compile."""
    cfg = compose_cfg("model=tiny", f"data.seq_len={SEQ}", "model.num_layers=2", "parallel.dp=2", "parallel.tp=2",
                      "parallel.pp=2", "parallel.micro_batches=2", "parallel.optimizer_shard=true")
    model = build_model(cfg.model, SEQ, "fp32", "CPU", 0, sharded=True)
    assert all(p.has_init for p in model.trainable_params() if p.ndim == 2)  # no data until the sharded compile
    objective = objective_plugin("clm").Objective(cfg.objective)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, 10, "CPU", sharded=True)
    assert all(m.has_init for m in optimizer.exp_avg if m.ndim == 2)
    module = ShardedModule(model, objective, optimizer, cfg, rank=5, run_dir="/nonexistent")
    assert module.stage == 1  # rank 5 of dp2 x tp2 x pp2: the last stage
    assert isinstance(module.evaluation.network, PipelinedLoss) and module.evaluation.network.micro_size == 2
    assert module.evaluation._pipeline_stages == 2 and module.evaluation._pipeline_result_broadcast
    assert module.compiled._enable_parallel_optimizer and module.compiled._pipeline_stages == 2

    # the eval graph, run here without its layout (stand-alone: the sums of 2 micro-batches), as the module calls it
    standalone = module.evaluation.network
    monkeypatch.setattr(module, "evaluation", type("Graph", (), {
        "__call__": lambda self, *inputs: standalone(*inputs),
        "dataset_strategy": lambda self, config: fed.append(config)})())
    fed = []
    inputs = batch()
    means, tokens = module.evaluate([inputs])
    assert fed == [((2, 1), (2, 1))]
    with eager():
        whole = float(loss_cell(objective, model)(*map(Tensor, inputs))[0].asnumpy())
    assert means["loss"] == pytest.approx(whole, rel=1e-5) and tokens == objective.loss_tokens(inputs)


def test_each_rank_saves_its_slices_not_gathered_parameters(tmp_path, monkeypatch):
    """MindSpore's save_checkpoint defaults to integrated_save=True: under tp or optimizer sharding every rank would
    all-gather and write whole parameters labelled as slices, and under pipeline parallelism it refuses. The per-rank
    save asks for the slices; on one device that is the same file, checked here as written."""
    from distributed import semi_auto

    _, net, optimizer, _ = tiny()
    step = ShardedTrainStep(net, optimizer, 1.0, pp=1, micro_batches=1, optimizer_shard=False)
    calls = []
    save = ms.save_checkpoint
    monkeypatch.setattr(ms, "save_checkpoint", lambda *args, **kw: (calls.append(kw), save(*args, **kw))[1])
    semi_auto.save_rank_slices(str(tmp_path / "step_000001"), step, rank=1, run_dir=str(tmp_path))
    assert calls == [{"integrated_save": False, "format": "safetensors"}]
    saved = ms.load_checkpoint(str(tmp_path / "step_000001" / "rank_1" / "checkpoint.safetensors"), format="safetensors")
    assert {p.name for p in optimizer.parameters} <= set(saved)
