"""The training loop, top to bottom: build data, model, objective and optimizer; resume; step; evaluate; save."""
import math
import os
import uuid

import numpy as np

import mindspore as ms
from mindspore import Tensor
from omegaconf import DictConfig, OmegaConf

from conf.schema import global_batch_size, is_sharded, pipeline_micro_batches
from data import build_data
from distributed.layout import Layout
from models import build_model
from objectives import build_objective
from trainer import checkpoint
from trainer.console import ConsoleProgress
from trainer.guard import SpikeGuard, TrainingStopped
from trainer.metrics import MetricsFile, SpeedMonitor, peak_rss_gb
from trainer.optimizer import build_optimizer
from trainer.runtime import Preemption, init_runtime, rng_state, set_rng_state
from trainer.step import ApplyUpdate, DynamicLossScale, ForwardBackward


def train(cfg: DictConfig, run_dir: str) -> dict:
    """Train as `cfg` says, writing metrics.jsonl and checkpoints to `run_dir`; returns the last metrics."""
    rt = init_runtime(cfg)
    t, dp = cfg.trainer, cfg.parallel.dp
    sharded = is_sharded(cfg.parallel)  # tp/pp/optimizer sharding (Ascend/GPU): one semi-auto graph per step
    rows_per_batch = t.micro_batch_size * pipeline_micro_batches(cfg)  # a pipeline step takes all its micro-batches
    layout = Layout.from_config(cfg.parallel, cfg.model.num_layers)  # ranks of one tp group read the same data
    data = build_data(cfg.data, rows_per_batch, dp_rank=layout.coords(rt.rank).dp, dp_size=dp, seed=t.seed,
                      eval_batches=t.eval_batches)
    val = {source: [Tensor(b) for b in batches] for source, batches in data.val.items()}

    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device.target, t.seed)
    if cfg.stage.init_from:
        checkpoint.load_weights(cfg.stage.init_from, model)
    loss_net = build_objective(cfg.objective, model)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, t.max_steps)
    if sharded:
        from distributed.semi_auto import ShardedTrainStep, load_rank_slices, parallel_step, save_rank_slices, \
            shard_model

        shard_model(model, cfg)
        sharded_step = parallel_step(ShardedTrainStep(loss_net, optimizer, cfg.optim.clip_grad_norm, cfg.parallel.pp,
                                                      cfg.parallel.micro_batches, cfg.parallel.optimizer_shard),
                                     cfg, run_dir, rt.rank)
    else:
        forward_backward = ForwardBackward(loss_net, optimizer.parameters)  # gradients in the optimizer's order
        reducer, replica_mean = None, None
        if rt.world_size > 1:
            from distributed.data_parallel import ReplicaMean, gradient_reducer

            reducer, replica_mean = gradient_reducer(optimizer.parameters, rt.world_size), ReplicaMean(rt.world_size)
        apply_update = ApplyUpdate(optimizer, forward_backward.grad_buffers, cfg.optim.clip_grad_norm, reducer)
    p = cfg.precision
    scaler = DynamicLossScale(p.init_scale, p.growth_interval, p.growth_factor, p.backoff_factor) \
        if p.loss_scale == "dynamic" else None
    guard = SpikeGuard(t.spike_factor, t.spike_window, t.max_consecutive_skips)

    ckpt_root = os.path.join(run_dir, "checkpoints")
    state = {"step": 0, "run_id": uuid.uuid4().hex[:12], "skipped_steps": 0}
    resume_from = _resume_path(t.resume, ckpt_root)
    if resume_from and sharded:
        state = checkpoint.read_state(resume_from)
        load_rank_slices(resume_from, sharded_step, rt.rank,
                         Tensor(np.zeros((rows_per_batch, cfg.data.seq_len + 1), np.int32)))
    elif resume_from:
        state = checkpoint.load(resume_from, model, optimizer)
    if resume_from:
        data.train.load_state_dict(state["data"])
        guard.load_state_dict(state["guard"])
        set_rng_state(state["rng"])
        if scaler:
            scaler.scale, scaler.clean_steps = state["loss_scale"]
        print(f"[checkpoint] resumed from {resume_from} at step {state['step']} (run id {state['run_id']})")

    def snapshot(step: int) -> dict:
        return {"tokens_seen": step * tokens_per_step, "run_id": state["run_id"], "data": data.train.state_dict(),
                "guard": guard.state_dict(), "rng": rng_state(), "skipped_steps": skipped,
                "loss_scale": [scaler.scale, scaler.clean_steps] if scaler else None}

    def save(step: int) -> None:
        if sharded:  # every rank its slices
            step_dir = os.path.join(ckpt_root, f"step_{step:06d}")
            save_rank_slices(step_dir, sharded_step.network, rt.rank, run_dir)
            if rt.is_main:  # state.json and `latest`: what a resume looks for
                checkpoint.write_metadata(step_dir, step, snapshot(step), cfg, str(data.tokenizer.path))
                checkpoint.set_latest(ckpt_root, step_dir)
                checkpoint.prune(ckpt_root, t.keep_last, t.keep_every)
        elif rt.is_main:
            checkpoint.save(ckpt_root, step, model, optimizer, snapshot(step), cfg, str(data.tokenizer.path))
            checkpoint.prune(ckpt_root, t.keep_last, t.keep_every)

    start, skipped = state["step"], state["skipped_steps"]
    tokens_per_step = global_batch_size(cfg) * cfg.data.seq_len
    speed = SpeedMonitor(cfg.model, cfg.data.seq_len, cfg.device.peak_tflops, rt.world_size)
    progress = ConsoleProgress(t.max_steps, start, enabled=rt.is_main and cfg.logger.progress_bar)
    sinks = (_file_sinks(cfg, run_dir, state["run_id"], start) if rt.is_main else []) + [progress]
    preemption = Preemption()
    n_micro = Tensor(float(t.grad_accum), ms.float32)
    nan = Tensor(float("nan"), ms.float32)
    window, metrics = [], {}

    def log(m: dict) -> None:
        for sink in sinks:
            sink.log(m)

    for step in range(start + 1, t.max_steps + 1):
        scale = nan if step in t.inject_nan_steps else (scaler.tensor() if scaler else Tensor(1.0, ms.float32))
        position = data.train.position
        if sharded:  # the pipeline's micro-batches are this step's accumulation
            batch = Tensor(data.train.next_batch())
            step_loss, grad_norm, finite, lr = sharded_step(batch, batch, scale)
            step_loss, skip = float(step_loss.asnumpy()), None
        else:
            step_loss = 0.0
            for _ in range(t.grad_accum):
                batch = Tensor(data.train.next_batch())
                step_loss += float(forward_backward(batch, batch, scale).asnumpy()) / t.grad_accum
            if replica_mean is not None:  # every rank decides on the same, global loss
                step_loss = float(replica_mean(Tensor(step_loss, ms.float32)).asnumpy())
            skip = guard.check(step_loss)
            grad_norm, finite, lr = apply_update(scale, n_micro, Tensor(skip is None))
        finite = bool(finite.asnumpy())
        if scaler:
            scaler.update(finite)  # an overflow under fp16 is routine: the scaler backs off, the guard ignores it
        elif not finite and skip is None:
            skip = "non-finite gradients"
        skipped += not finite or skip is not None
        if skip:
            log({"step": step, "skipped": skip, "loss": step_loss if math.isfinite(step_loss) else None,
                 "data_position": position})
        try:
            guard.record(step_loss, skip)
        except TrainingStopped:
            save(step)
            raise
        if not skip:
            window.append(step_loss)
        speed.add(tokens_per_step)
        progress.advance()

        if window and (step % t.log_every == 0 or step == t.max_steps):  # an all-skipped interval has no loss
            metrics = {"step": step, "loss": float(np.mean(window)),
                       "lr": float(lr.asnumpy()), "grad_norm": float(grad_norm.asnumpy()),
                       "tokens_seen": step * tokens_per_step, **speed.measure(), "skipped_steps": skipped,
                       "peak_rss_gb": peak_rss_gb(),
                       **{f"tokens_seen/{source}": n * dp * cfg.data.seq_len
                          for source, n in data.train.samples_by_source().items()}}
            if scaler:
                metrics["loss_scale"] = scaler.scale
            window = []
            log(metrics)
        if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
            evaluation = evaluate(loss_net, val)
            metrics = {**metrics, **evaluation}
            log({"step": step, **evaluation})
        if (t.save_every and step % t.save_every == 0) or step == t.max_steps or preemption.signal:
            save(step)
        if preemption.signal:
            print(f"[checkpoint] {preemption.signal}: saved step {step}, exiting")
            metrics = {**metrics, "step": step, "preempted": preemption.signal}
            break

    if rt.world_size > 1:
        from distributed.data_parallel import weights_digest

        print(f"[data-parallel] rank {rt.rank} weights sha256 {weights_digest(model)}", flush=True)
    for sink in sinks:
        sink.close()
    return metrics


def _file_sinks(cfg: DictConfig, run_dir: str, run_id: str, start: int) -> list:
    sinks = [MetricsFile(run_dir, after_step=start)]
    if cfg.logger.name == "wandb":
        from trainer.wandb_logger import WandbLogger

        sinks.append(WandbLogger(cfg, run_dir, run_id))
    return sinks


def evaluate(loss_net, val: dict) -> dict:
    """Mean validation loss per source and over all validation batches, with perplexity."""
    losses = {source: [float(loss_net(b, b).asnumpy()) for b in batches] for source, batches in val.items()}
    overall = float(np.mean([x for per_source in losses.values() for x in per_source]))
    return {"val_loss": overall, "val_ppl": math.exp(min(overall, 50.0)),
            **{f"val_loss/{source}": float(np.mean(x)) for source, x in losses.items() if x}}


def _resume_path(resume: str, ckpt_root: str):
    if resume == "none":
        return None
    if resume == "auto":
        return checkpoint.latest_intact(ckpt_root)
    if not os.path.isdir(resume):
        raise checkpoint.CheckpointError(f"trainer.resume: {resume} is not a checkpoint directory")
    return resume


def save_resolved_config(cfg: DictConfig, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"), resolve=True)
