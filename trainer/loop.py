"""The training loop, top to bottom: build data, model, objective and train module; resume; step; let the
callbacks log, evaluate and save. It knows no objective, stage or layout: those are plug-ins
(objectives/, conf/stage/, trainer/module.py)."""
import math
import os
import time
import uuid
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf

from base import checkpoint
from base.errors import ConfigError
from base.schema import global_batch_size, is_sharded, peak_tflops, pipeline_micro_batches
from data import build_data
from models import build_model, family
from objectives import objective as objective_plugin
from planner.layout import Layout
from trainer.callbacks import (Callbacks, Checkpointing, Evaluation, FamilyUpdate, GuardStop, PreemptionNotice, Sinks,
                               SkipLog, TrainMetrics, WeightsDigest)
from trainer.console import ConsoleProgress
from trainer.guard import SpikeGuard
from trainer.metrics import MetricsFile, SpeedMonitor
from trainer.module import ShardedModule, local_module
from trainer.optimizer import build_optimizer
from trainer.runtime import Preemption, init_runtime
from trainer.state import Checkpointer, RandomState, RunState
from trainer.step import DynamicLossScale


def train(cfg: DictConfig, run_dir: str) -> dict:
    """Train as `cfg` says, writing metrics.jsonl and checkpoints to `run_dir`; returns the last metrics."""
    rt = init_runtime(cfg)
    _check_before_building(cfg, rt)
    os.makedirs(run_dir, exist_ok=True)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    resume_from = _resume_path(cfg.trainer.resume, ckpt_root)
    if resume_from:  # its optimizer state is this preset's (base/checkpoint.py check_optimizer says why it must be)
        checkpoint.check_optimizer(resume_from, cfg.optim.name)
    t, sharded = cfg.trainer, is_sharded(cfg.parallel)  # sharded: tp/pp/optimizer sharding, one semi-auto graph
    dp_rank = Layout.from_config(cfg.parallel, cfg.model.num_layers).coords(rt.rank).dp  # a tp group reads alike
    data, objective, model, lm, module = _build(cfg, rt, run_dir, dp_rank, sharded)
    val = {} if objective.next_inputs is not None else {  # a rollout objective: no val rows
        source: [objective.batch(b, -1 - i) for i, b in enumerate(batches)] for source, batches in data.val.items()}
    downstream = _downstream(cfg, lm, objective, data, val)  # (task files are read here: before any file is written)

    scaler = _loss_scale(cfg.precision)
    guard = SpikeGuard(t.spike_factor, t.spike_window, t.max_consecutive_skips)
    run = RunState(uuid.uuid4().hex[:12], cfg.optim.name, global_batch_size(cfg) * cfg.data.seq_len)
    parts = {"data": data.train, **({"objective": objective} if objective.state_dict is not None else {}),
             "guard": guard, "rng": RandomState(), "loss_scale": scaler}
    checkpointer = Checkpointer(module, run, parts, ckpt_root, cfg, str(data.tokenizer.path), rt.is_main)
    if resume_from:
        example = objective.batch(data.train.next_batch(), 0) if sharded else None  # sharded: compile before loading
        checkpointer.restore(resume_from, example)
        print(f"[checkpoint] resumed from {resume_from} at step {run.step} (run id {run.run_id})")

    callbacks, train_metrics, evaluation, preemption = _callbacks(cfg, rt, run_dir, data, objective, model, module,
                                                                  val, downstream, run, scaler, guard, checkpointer)
    next_inputs = _inputs(objective, data, cfg.parallel.dp, dp_rank)
    micro_steps = 1 if sharded else t.grad_accum
    step = start = run.step
    callbacks.on_start(start)
    for step in range(start + 1, t.max_steps + 1):
        scale = math.nan if step in t.inject_nan_steps else (scaler.scale if scaler else 1.0)
        began = time.perf_counter()
        inputs = [next_inputs() for _ in range(micro_steps)]
        made = time.perf_counter()
        result = module.step(inputs, scale, guard)
        result.seconds = {"inputs": made - began, "update": time.perf_counter() - made}
        if scaler:
            scaler.update(result.finite)  # an overflow under fp16 is routine: the scaler backs off, the guard ignores it
        elif not result.finite and result.skip is None:
            result.skip = "non-finite gradients"
        run.skipped_steps += not result.finite or result.skip is not None
        callbacks.on_step(step, result)
        if preemption.signal:
            break
    callbacks.on_end(step)
    if rt.is_main and train_metrics.time_line():
        print(train_metrics.time_line(), flush=True)
    return {**train_metrics.last, **evaluation.last, "step": step,
            **({"preempted": preemption.signal} if preemption.signal else {})}


def _check_before_building(cfg: DictConfig, rt) -> None:
    """What can fail in seconds, checked before minutes of data and model building: W&B's credentials, the
    checkpoint stage.init_from names."""
    if rt.is_main and cfg.logger.name == "wandb":
        from trainer.wandb_logger import check_credentials

        check_credentials(cfg.logger.mode)
    if cfg.stage.init_from:
        checkpoint.weights_file(cfg.stage.init_from, whole=True)


def _build(cfg: DictConfig, rt, run_dir: str, dp_rank: int, sharded: bool) -> tuple:
    """(data, objective, model as trained, the language model inside it, train module) as `cfg` says: the stage's
    weights loaded, LoRA applied, the objective's additions attached, the optimizer over what trains."""
    t = cfg.trainer
    rows_per_batch = t.micro_batch_size * pipeline_micro_batches(cfg)  # a pipeline step takes all its micro-batches
    plugin = objective_plugin(cfg.objective.name)
    data = build_data(cfg.data, rows_per_batch, dp_rank=dp_rank, dp_size=cfg.parallel.dp, seed=t.seed,
                      eval_batches=t.eval_batches, spec=plugin.row_spec(cfg.objective), fit_small_val=not sharded)
    if cfg.stage.init_from:  # the checkpoint must read the data's ids as the same text
        checkpoint.check_same_tokenizer("data.tokenizer.path", f"stage.init_from={cfg.stage.init_from}",
                                        checkpoint.tokenizer_of(cfg.stage.init_from), f"data={cfg.data.name}",
                                        str(data.tokenizer.path))
    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device.target, t.seed, sharded)
    if cfg.stage.init_from:
        checkpoint.load_weights(cfg.stage.init_from, model)
    adapters = add_adapters(model, cfg) if cfg.peft.name != "none" else None  # LoRA: the base frozen
    objective = plugin.Objective(cfg.objective, data.tokenizer, t.seed)
    lm = model  # the language model itself, before an objective wraps it (what evaluation tasks score)
    if objective.attach is not None:  # e.g. the reward model's head, DPO's frozen reference
        model = objective.attach(model, cfg)
        if adapters:  # a LoRA run saves what it trains: the adapters and any head the objective added
            adapters = adapters._replace(names={param.name for param in model.trainable_params()})
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, t.max_steps, cfg.device.target, sharded)
    module = ShardedModule(model, objective, optimizer, cfg, rt.rank, run_dir) if sharded else \
        local_module(model, objective, optimizer, cfg, rt.world_size, adapters)
    return data, objective, model, lm, module


def _loss_scale(precision) -> Optional[DynamicLossScale]:
    """precision.loss_scale=dynamic's scale; None for a static one."""
    if precision.loss_scale != "dynamic":
        return None
    return DynamicLossScale(precision.init_scale, precision.growth_interval, precision.growth_factor,
                            precision.backoff_factor)


def _inputs(objective, data, dp: int, dp_rank: int) -> Callable[[], tuple]:
    """The objective's inputs for each next micro-batch (a rollout objective samples its own from rows)."""

    def draw() -> tuple:
        """This rank's next batch of rows and the global index of its first sample."""
        sample = data.train.position * dp + dp_rank
        return data.train.next_batch(), sample

    if objective.next_inputs is not None:
        return lambda: objective.next_inputs(draw)
    return lambda: objective.batch(*draw())


def _callbacks(cfg: DictConfig, rt, run_dir: str, data, objective, model, module, val, downstream, run: RunState,
               scaler, guard: SpikeGuard, checkpointer: Checkpointer) -> tuple:
    """(the run's Callbacks, its TrainMetrics, its Evaluation, its Preemption): one callback per concern, in the
    order the loop calls them (trainer/callbacks.py)."""
    t, start = cfg.trainer, run.step
    read_model = family(cfg.model.family).step_metrics  # the family's numbers: a router's load, dropped tokens
    model_metrics = lambda: {} if read_model is None else read_model(model)
    progress = ConsoleProgress(t.max_steps, start, enabled=rt.is_main, keys=(*objective.console, *model_metrics()),
                               bar=cfg.logger.progress_bar)
    sinks = Sinks((_file_sinks(cfg, run_dir, run.run_id, start) if rt.is_main else []) + [progress])
    if rt.is_main:  # once everything is built: a start that fails (bad data, checkpoint) keeps the previous one
        save_resolved_config(cfg, run_dir)
    preemption = Preemption()
    speed = SpeedMonitor(cfg.model, cfg.data.seq_len, peak_tflops(cfg), rt.world_size)
    dp, seq_len = cfg.parallel.dp, cfg.data.seq_len
    tokens_by_source = lambda: {s: n * dp * seq_len for s, n in data.train.samples_by_source().items()}
    extra = lambda: {"skipped_steps": run.skipped_steps, **({"loss_scale": scaler.scale} if scaler else {}),
                     **(objective.logged or {}),  # an objective's host-side numbers (PPO's rollout)
                     **model_metrics(),
                     **({} if cfg.device.target == "CPU" else {"peak_device_memory_gb": _peak_device_memory_gb()})}
    callbacks = Callbacks()
    after_step = family(cfg.model.family).after_step
    if after_step is not None:
        callbacks.add(FamilyUpdate(after_step, model, cfg.model))
    train_metrics = TrainMetrics(sinks, t.log_every, t.max_steps, speed, run.tokens_per_step, tokens_by_source,
                                 extra, objective.timings)
    evaluation = Evaluation(callbacks, t.eval_every, t.max_steps, t.eval_at_start, module, val, *downstream)
    callbacks.add(SkipLog(sinks, data.train), GuardStop(guard, checkpointer.save), progress, train_metrics,
                  evaluation, Checkpointing(checkpointer.save, callbacks, t.save_every, t.max_steps, preemption),
                  PreemptionNotice(preemption), *([WeightsDigest(model, rt.rank)] if rt.world_size > 1 else []), sinks)
    return callbacks, train_metrics, evaluation, preemption


def _peak_device_memory_gb() -> float:
    """The most of the accelerator's memory pool this process's tensors have held (MindSpore reports 0 on CPU)."""
    import mindspore as ms

    return ms.runtime.max_memory_allocated() / 2**30


def _downstream(cfg: DictConfig, lm, objective, data, val) -> tuple:
    """What Evaluation measures besides the objective: (the val targets' UTF-8 bytes when the objective's loss
    is a per-token NLL, for bits per byte; the trainer.eval_tasks scorer), each None when not wanted."""
    from data.samples import template_of
    from evaluation.bpb import val_target_bytes
    from evaluation.tasks import task_scorer

    tasks, t = None, cfg.trainer
    if t.eval_tasks:  # Alpaca task files prompted as this run's samples are (its template: the checkpoint's)
        tasks = task_scorer(t.eval_tasks, t.eval_task_items, objective, lm, cfg.model.family, data.tokenizer,
                            t.micro_batch_size, cfg.data.seq_len, template=template_of(cfg))
    return val_target_bytes(objective, val, data.tokenizer), tasks


def add_adapters(model, cfg: DictConfig):
    """LoRA on `model` as cfg.peft says; returns what its checkpoints hold."""
    from adapters.lora import Adapters, apply_lora, describe, lora_state, peft_adapter_files, single_name
    from models import family

    try:
        info = apply_lora(model, cfg.peft, cfg.trainer.seed)
    except ValueError as err:
        raise ConfigError("peft.target_modules", str(err).removeprefix("peft.target_modules=")) from None
    print(f"[peft] {describe(info)}", flush=True)
    weights = lora_state(model)
    _, adapter_config = peft_adapter_files(weights, cfg.peft, single_name(family(cfg.model.family).hf.to_hf),
                                           cfg.stage.init_from or "")
    return Adapters(set(weights), adapter_config)


def _file_sinks(cfg: DictConfig, run_dir: str, run_id: str, start: int) -> list:
    sinks = [MetricsFile(run_dir, after_step=start)]
    if cfg.logger.name == "wandb":
        from trainer.wandb_logger import WandbLogger

        sinks.append(WandbLogger(cfg, run_dir, run_id))
    return sinks


def _resume_path(resume: str, ckpt_root: str):
    if resume == "none":
        return None
    if resume == "auto":
        return checkpoint.latest_intact(ckpt_root)
    path = checkpoint.resolve(resume)  # a step, `latest`, the run's checkpoints/ or the run directory
    if not os.path.isdir(path):
        raise checkpoint.CheckpointError(f"trainer.resume: {resume} is not a checkpoint directory")
    return path


def save_resolved_config(cfg: DictConfig, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"), resolve=True)
