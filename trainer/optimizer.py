"""AdamW with per-group weight decay and its learning-rate schedule (MindFormers' schedule classes)."""
from typing import List

from mindspore import nn
from mindformers.core.lr.lr_schedule import CosineWithWarmUpLR, WarmUpStableDecayLR, ConstantWarmUpLR

from conf.schema import OptimConfig


def build_schedule(cfg: OptimConfig, max_steps: int) -> nn.learning_rate_schedule.LearningRateSchedule:
    """lr as a function of the number of applied updates (skipped fp16 overflow steps do not advance it)."""
    if cfg.schedule == "cosine":
        return CosineWithWarmUpLR(learning_rate=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=max_steps,
                                  lr_end=cfg.min_lr)
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup_steps, int(max_steps * (1 - cfg.decay_fraction)))
        return WarmUpStableDecayLR(learning_rate=cfg.lr, lr_end=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                                   total_steps=max_steps, decay_start_steps=decay_start)
    return ConstantWarmUpLR(learning_rate=cfg.lr, warmup_steps=cfg.warmup_steps)


def param_groups(params: List, cfg: OptimConfig) -> List[dict]:
    """Weight decay on matrices only: names containing any of `cfg.no_decay` (norms, embeddings, biases) are exempt."""
    decay = [p for p in params if not any(s in p.name for s in cfg.no_decay)]
    no_decay = [p for p in params if any(s in p.name for s in cfg.no_decay)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(params: List, cfg: OptimConfig, max_steps: int) -> nn.Optimizer:
    beta1, beta2 = cfg.betas
    return nn.AdamWeightDecay(param_groups(params, cfg), learning_rate=build_schedule(cfg, max_steps),
                              beta1=beta1, beta2=beta2, eps=cfg.eps)
