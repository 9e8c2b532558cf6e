"""The training loop, top to bottom: build data, model, objective and optimizer; step; evaluate; save."""
import math
import os

import numpy as np

import mindspore as ms
from mindspore import Tensor
from omegaconf import DictConfig, OmegaConf

from data import build_data, eval_batches
from models import build_model
from objectives import build_objective
from trainer import checkpoint
from trainer.console import ConsoleProgress
from trainer.metrics import MetricsFile, SpeedMonitor, peak_rss_gb
from trainer.optimizer import build_optimizer
from trainer.runtime import init_runtime
from trainer.step import ApplyUpdate, DynamicLossScale, ForwardBackward


def train(cfg: DictConfig, run_dir: str) -> dict:
    """Train as `cfg` says, writing metrics.jsonl and checkpoints to `run_dir`; returns the last metrics."""
    rt = init_runtime(cfg)
    t, dp = cfg.trainer, cfg.parallel.dp
    data = build_data(cfg.data, t.micro_batch_size, dp_rank=rt.rank % dp, dp_size=dp, seed=t.seed)
    val = [Tensor(b) for b in eval_batches(data.val_tokens, cfg.data.seq_len, t.micro_batch_size, t.eval_batches)]

    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device.target, t.seed)
    if cfg.stage.init_from:
        checkpoint.load_weights(cfg.stage.init_from, model)
    loss_net = build_objective(cfg.objective, model)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, t.max_steps)
    forward_backward = ForwardBackward(loss_net, optimizer.parameters)  # gradients in the optimizer's order
    apply_update = ApplyUpdate(optimizer, forward_backward.grad_buffers, cfg.optim.clip_grad_norm)
    p = cfg.precision
    scaler = DynamicLossScale(p.init_scale, p.growth_interval, p.growth_factor, p.backoff_factor) \
        if p.loss_scale == "dynamic" else None

    tokens_per_step = t.micro_batch_size * dp * t.grad_accum * cfg.data.seq_len
    speed = SpeedMonitor(cfg.model, cfg.data.seq_len, cfg.device.peak_tflops, rt.world_size)
    progress = ConsoleProgress(t.max_steps, enabled=rt.is_main and cfg.logger.progress_bar)
    sinks = ([MetricsFile(run_dir)] if rt.is_main else []) + [progress]
    n_micro = Tensor(float(t.grad_accum), ms.float32)
    one = Tensor(1.0, ms.float32)
    window, skipped, metrics = [], 0, {}

    def log(m: dict) -> None:
        for sink in sinks:
            sink.log(m)

    for step in range(1, t.max_steps + 1):
        scale = scaler.tensor() if scaler else one
        step_loss = 0.0
        for _ in range(t.grad_accum):
            batch = Tensor(data.train.next_batch())
            step_loss += float(forward_backward(batch, batch, scale).asnumpy()) / t.grad_accum
        grad_norm, finite, lr = apply_update(scale, n_micro)
        finite = bool(finite.asnumpy())
        if scaler:
            scaler.update(finite)
        skipped += not finite
        window.append(step_loss)
        speed.add(tokens_per_step)
        progress.advance()

        if step % t.log_every == 0 or step == t.max_steps:
            metrics = {"step": step, "loss": float(np.mean(window)), "lr": float(lr.asnumpy()),
                       "grad_norm": float(grad_norm.asnumpy()), "tokens_seen": step * tokens_per_step,
                       **speed.measure(), "skipped_steps": skipped, "peak_rss_gb": peak_rss_gb()}
            if scaler:
                metrics["loss_scale"] = scaler.scale
            window = []
            log(metrics)
        if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
            val_loss = float(np.mean([loss_net(b, b).asnumpy() for b in val]))
            metrics = {**metrics, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
            log({"step": step, "val_loss": val_loss, "val_ppl": metrics["val_ppl"]})
        if rt.is_main and ((t.save_every and step % t.save_every == 0) or step == t.max_steps):
            checkpoint.save(run_dir, step, model, optimizer,
                            {"tokens_seen": step * tokens_per_step, "loss_scale": scaler.scale if scaler else None,
                             "data": data.train.state_dict()})

    for sink in sinks:
        sink.close()
    return metrics


def save_resolved_config(cfg: DictConfig, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"), resolve=True)
