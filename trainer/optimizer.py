"""The optimizer presets (conf/optim/<name>.yaml) with per-group weight decay, and their learning-rate schedule
(trainer/schedules.py).

    adamw       trainer/adamw.py AdamW: bias-corrected moments and decoupled weight decay, torch.optim.AdamW's update
                (tests/test_step_reference.py checks whole training steps against it); on CPU in fp32 outside a
                sharded layout, FusedAdamW (trainer/fused_adamw.py: kernels/optimizer.cc) where it is built
    adamw_bert  MindSpore's nn.AdamWeightDecay: the same without bias correction (BERT's optimizer)
    came        MindFormers' Came, its weight decay applied here per group (Came itself decays every parameter)

Each optimizer's update count is its `global_step` parameter: it is saved in optimizer.safetensors, so the
schedule and AdamW's bias correction (1 - beta^t) resume exactly. A step skipped for non-finite gradients
does not call the optimizer, so it advances neither.

A native run imports no MindFormers (importing it prints two hyper_parallel warnings): AdamW and the schedules
are native, equal to MindFormers' classes (tests/test_step.py), and Came is imported only when optim=came.
"""
from typing import List

from mindspore import nn, ops

from base.schema import OptimConfig
from models import deferred_initialisation
from trainer.adamw import AdamW, ClippedUpdates
from trainer.schedules import WarmupConstant, WarmupCosine, WarmupStableDecay


def warmup_steps(cfg: OptimConfig, max_steps: int) -> int:
    """optim.warmup_steps, or when unset warmup_fraction of the run."""
    return cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_fraction * max_steps)


def build_schedule(cfg: OptimConfig, max_steps: int) -> nn.learning_rate_schedule.LearningRateSchedule:
    """lr as a function of the number of applied updates (skipped fp16 overflow steps do not advance it)."""
    warmup = warmup_steps(cfg, max_steps)
    if cfg.schedule == "cosine":
        return WarmupCosine(cfg.lr, warmup, max_steps, cfg.min_lr)
    if cfg.schedule == "wsd":
        decay_start = max(warmup, int(max_steps * (1 - cfg.decay_fraction)))
        return WarmupStableDecay(cfg.lr, warmup, max_steps, decay_start, cfg.min_lr)
    return WarmupConstant(cfg.lr, warmup)


def decays(name: str, cfg: OptimConfig) -> bool:
    """Weight decay on matrices only: names containing any of `cfg.no_decay` (norms, embeddings, biases) are exempt."""
    return not any(s in name for s in cfg.no_decay)


def param_groups(params: List, cfg: OptimConfig) -> List[dict]:
    decay = [p for p in params if decays(p.name, cfg)]
    no_decay = [p for p in params if not decays(p.name, cfg)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(params: List, cfg: OptimConfig, max_steps: int, device="CPU",
                    sharded: bool = False) -> nn.Optimizer:
    """The `optim` preset over `params`; `device` and `sharded` (the run's device preset, or a target naming one,
    and base.schema.is_sharded(parallel)) choose AdamW's kernel version where it applies (trainer/fused_adamw.py)."""
    with deferred_initialisation(sharded):  # the moments too: each rank initialises its slices when it compiles
        return _build_optimizer(params, cfg, max_steps, device, sharded)


def _build_optimizer(params: List, cfg: OptimConfig, max_steps: int, device, sharded: bool):
    lr = build_schedule(cfg, max_steps)
    if cfg.name == "adamw":
        from trainer import fused_adamw

        adamw = fused_adamw.FusedAdamW if fused_adamw.applies(params, device, sharded) else AdamW
        return adamw(param_groups(params, cfg), learning_rate=lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adamw_bert":
        beta1, beta2 = cfg.betas
        return AdamWeightDecay(param_groups(params, cfg), learning_rate=lr, beta1=beta1, beta2=beta2, eps=cfg.eps)
    if cfg.name == "came":
        from mindformers.core.optim import Came  # MindFormers (and its import warnings) only when chosen

        came = Came(params, learning_rate=lr, eps=(cfg.eps[0], 1e-3, cfg.eps[1]), clip_threshold=cfg.clip_threshold,
                    decay_rate=cfg.decay_rate, beta1=cfg.beta1, beta3=cfg.beta3)
        return GroupWeightDecay(came, [p for p in params if decays(p.name, cfg)], cfg.weight_decay)
    raise ValueError(f"optim.name={cfg.name!r} has no builder (base/validate.py admits only buildable ones)")


class AdamWeightDecay(ClippedUpdates, nn.AdamWeightDecay):
    """MindSpore's AdamWeightDecay (adamw_bert), its state names unchanged."""


class GroupWeightDecay(ClippedUpdates, nn.Cell):
    """`optimizer` (built without weight decay) after decoupled decay w -= lr * weight_decay * w of `decay`.

    Looks like an nn.Optimizer to the step and the checkpoints: `parameters`, `get_lr()`, parameters_dict()."""

    def __init__(self, optimizer: nn.Optimizer, decay: List, weight_decay: float):
        super().__init__(auto_prefix=False)  # keep the optimizer's state names
        self.optimizer = optimizer
        self.parameters = optimizer.parameters
        self.decay = decay
        self.weight_decay = weight_decay

    def get_lr(self):
        return self.optimizer.get_lr()

    def construct(self, gradients):
        keep = 1.0 - self.optimizer.get_lr() * self.weight_decay  # the lr of this update (before global_step moves)
        for param in self.decay:
            ops.assign(param, param * keep)
        return self.optimizer(gradients)
