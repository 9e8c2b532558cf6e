"""The training loop, top to bottom: build data, model, objective and train module; resume; step; let the
callbacks log, evaluate and save. It knows no objective, stage or layout: those are plug-ins
(objectives/, conf/stage/, trainer/module.py)."""
import math
import os
import uuid

import numpy as np
from omegaconf import DictConfig, OmegaConf

from base import checkpoint
from base.errors import ConfigError
from base.schema import global_batch_size, is_sharded, peak_tflops, pipeline_micro_batches
from data import build_data
from models import build_model, family
from objectives import objective as objective_plugin
from planner.layout import Layout
from trainer.callbacks import Checkpointing, Evaluation, Sinks, TrainMetrics
from trainer.console import ConsoleProgress
from trainer.guard import SpikeGuard, TrainingStopped
from trainer.metrics import MetricsFile, SpeedMonitor
from trainer.module import ShardedModule, local_module
from trainer.optimizer import build_optimizer
from trainer.runtime import Preemption, init_runtime, rng_state, set_rng_state
from trainer.step import DynamicLossScale


def train(cfg: DictConfig, run_dir: str) -> dict:
    """Train as `cfg` says, writing metrics.jsonl and checkpoints to `run_dir`; returns the last metrics."""
    rt = init_runtime(cfg)
    if rt.is_main and cfg.logger.name == "wandb":
        from trainer.wandb_logger import check_credentials

        check_credentials(cfg.logger.mode)
    if cfg.stage.init_from:  # the checkpoints named are there, before minutes of data and model building
        checkpoint.weights_file(cfg.stage.init_from, whole=True)
    os.makedirs(run_dir, exist_ok=True)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    resume_from = _resume_path(cfg.trainer.resume, ckpt_root)
    if resume_from:  # its optimizer state is this preset's (base/checkpoint.py check_optimizer says why it must be)
        checkpoint.check_optimizer(resume_from, cfg.optim.name)
    t, dp = cfg.trainer, cfg.parallel.dp
    sharded = is_sharded(cfg.parallel)  # tp/pp/optimizer sharding (Ascend/GPU): one semi-auto graph per step
    rows_per_batch = t.micro_batch_size * pipeline_micro_batches(cfg)  # a pipeline step takes all its micro-batches
    micro_steps = 1 if sharded else t.grad_accum
    layout = Layout.from_config(cfg.parallel, cfg.model.num_layers)  # ranks of one tp group read the same data
    dp_rank = layout.coords(rt.rank).dp
    plugin = objective_plugin(cfg.objective.name)
    data = build_data(cfg.data, rows_per_batch, dp_rank=dp_rank, dp_size=dp, seed=t.seed,
                      eval_batches=t.eval_batches, spec=plugin.row_spec(cfg.objective))
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
            adapters = ({p.name for p in model.trainable_params()}, adapters[1])
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, t.max_steps, cfg.device.target, sharded)
    module = ShardedModule(model, objective, optimizer, cfg, rt.rank, run_dir) if sharded else \
        local_module(model, objective, optimizer, cfg, rt.world_size, adapters)
    val = {} if objective.next_inputs is not None else {  # a rollout objective: no val rows
        source: [objective.batch(b, -1 - i) for i, b in enumerate(batches)] for source, batches in data.val.items()}
    downstream = _downstream(cfg, lm, objective, data, val)  # (task files are read here: before any file is written)

    def draw() -> tuple:
        """This rank's next batch of rows and the global index of its first sample."""
        sample = data.train.position * dp + dp_rank
        return data.train.next_batch(), sample

    def next_inputs() -> tuple:
        """The objective's inputs for the next micro-batch (a rollout objective samples its own from rows)."""
        if objective.next_inputs is not None:
            return objective.next_inputs(draw)
        return objective.batch(*draw())

    p = cfg.precision
    scaler = DynamicLossScale(p.init_scale, p.growth_interval, p.growth_factor, p.backoff_factor) \
        if p.loss_scale == "dynamic" else None
    guard = SpikeGuard(t.spike_factor, t.spike_window, t.max_consecutive_skips)
    state = {"step": 0, "run_id": uuid.uuid4().hex[:12], "skipped_steps": 0}
    if resume_from:
        example = objective.batch(data.train.next_batch(), 0) if sharded else None  # sharded: compile before loading
        state = module.load(resume_from, example)
        data.train.load_state_dict(state["data"])
        if "objective" in state:  # e.g. PPO's rollout buffer and KL coefficient
            objective.load_state_dict(state["objective"])
        guard.load_state_dict(state["guard"])
        set_rng_state(state["rng"])
        if scaler:
            scaler.scale, scaler.clean_steps = state["loss_scale"]
        print(f"[checkpoint] resumed from {resume_from} at step {state['step']} (run id {state['run_id']})")
    start, skipped = state["step"], state["skipped_steps"]
    tokens_per_step = global_batch_size(cfg) * cfg.data.seq_len

    def save(step: int) -> None:
        snapshot = {"tokens_seen": step * tokens_per_step, "run_id": state["run_id"], "optimizer": cfg.optim.name,
                    "data": data.train.state_dict(), "guard": guard.state_dict(), "rng": rng_state(),
                    "skipped_steps": skipped, "loss_scale": [scaler.scale, scaler.clean_steps] if scaler else None,
                    **({"objective": objective.state_dict()} if objective.state_dict is not None else {})}
        module.save(ckpt_root, step, snapshot, cfg, str(data.tokenizer.path), rt.is_main)
        if rt.is_main:
            checkpoint.prune(ckpt_root, t.keep_last, t.keep_every)

    read_model = family(cfg.model.family).step_metrics  # the family's numbers: a router's load, dropped tokens
    model_metrics = lambda: {} if read_model is None else read_model(model)
    progress = ConsoleProgress(t.max_steps, start, enabled=rt.is_main,
                               keys=(*objective.console, *model_metrics()),
                               bar=cfg.logger.progress_bar)
    sinks = Sinks((_file_sinks(cfg, run_dir, state["run_id"], start) if rt.is_main else []) + [progress])
    if rt.is_main:  # once everything is built: a start that fails (bad data, checkpoint) keeps the previous one
        save_resolved_config(cfg, run_dir)
    preemption = Preemption()
    speed = SpeedMonitor(cfg.model, cfg.data.seq_len, peak_tflops(cfg), rt.world_size)
    tokens_by_source = lambda: {s: n * dp * cfg.data.seq_len for s, n in data.train.samples_by_source().items()}
    extra = lambda: {"skipped_steps": skipped, **({"loss_scale": scaler.scale} if scaler else {}),
                     **(objective.logged or {}),  # an objective's host-side numbers (PPO's rollout)
                     **model_metrics(),
                     **({} if cfg.device.target == "CPU" else {"peak_device_memory_gb": _peak_device_memory_gb()})}
    train_metrics = TrainMetrics(sinks, t.log_every, t.max_steps, speed, tokens_per_step, tokens_by_source, extra)
    evaluation = Evaluation(sinks, t.eval_every, t.max_steps, module, val, *downstream)
    callbacks = [train_metrics, evaluation, Checkpointing(save, t.save_every, t.max_steps, preemption)]

    if start == 0 and t.eval_at_start:  # the "before" every later evaluation is compared with
        evaluation.log(0)
    step = start
    for step in range(start + 1, t.max_steps + 1):
        scale = math.nan if step in t.inject_nan_steps else (scaler.scale if scaler else 1.0)
        position = data.train.position
        result = module.step([next_inputs() for _ in range(micro_steps)], scale, guard)
        if scaler:
            scaler.update(result.finite)  # an overflow under fp16 is routine: the scaler backs off, the guard ignores it
        elif not result.finite and result.skip is None:
            result.skip = "non-finite gradients"
        skipped += not result.finite or result.skip is not None
        if result.skip:
            sinks.log({"step": step, "skipped": result.skip, "data_position": position,
                       "loss": result.loss if math.isfinite(result.loss) else None})
        try:
            guard.record(result.loss, result.skip)
        except TrainingStopped:
            save(step)
            raise
        progress.advance()
        for callback in callbacks:
            callback.on_step(step, result)
        if preemption.signal:
            print(f"[checkpoint] {preemption.signal}: saved step {step}, exiting")
            break

    if rt.world_size > 1:
        from distributed.data_parallel import weights_digest

        print(f"[data-parallel] rank {rt.rank} weights sha256 {weights_digest(model)}", flush=True)
    sinks.close()
    return {**train_metrics.last, **evaluation.last, "step": step,
            **({"preempted": preemption.signal} if preemption.signal else {})}


def _peak_device_memory_gb() -> float:
    """The most of the accelerator's memory pool this process's tensors have held (MindSpore reports 0 on CPU)."""
    import mindspore as ms

    return ms.runtime.max_memory_allocated() / 2**30


def _downstream(cfg: DictConfig, lm, objective, data, val) -> tuple:
    """What Evaluation measures besides the objective: (the val targets' UTF-8 bytes when the objective's loss
    is a per-token NLL, for bits per byte; the trainer.eval_tasks scorer), each None when not wanted."""
    from evaluation.bpb import val_target_bytes
    from evaluation.tasks import task_scorer

    tasks, t = None, cfg.trainer
    if t.eval_tasks:
        tasks = task_scorer(t.eval_tasks, t.eval_task_items, objective, lm, cfg.model.family, data.tokenizer,
                            t.micro_batch_size, cfg.data.seq_len)
    return val_target_bytes(objective, val, data.tokenizer), tasks


def add_adapters(model, cfg: DictConfig):
    """LoRA on `model` as cfg.peft says; returns what its checkpoints hold: (adapter names, PEFT adapter_config)."""
    from adapters.lora import apply_lora, describe, lora_state, peft_adapter_files, single_name
    from models import family

    try:
        info = apply_lora(model, cfg.peft, cfg.trainer.seed)
    except ValueError as err:
        raise ConfigError("peft.target_modules", str(err).removeprefix("peft.target_modules=")) from None
    print(f"[peft] {describe(info)}", flush=True)
    weights = lora_state(model)
    _, adapter_config = peft_adapter_files(weights, cfg.peft, single_name(family(cfg.model.family).hf.to_hf),
                                           cfg.stage.init_from or "")
    return set(weights), adapter_config


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
