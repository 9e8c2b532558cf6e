"""The optimizer presets (conf/optim/<name>.yaml) with per-group weight decay, and their learning-rate schedule
(trainer/schedules.py).

    adamw       AdamW below: bias-corrected moments and decoupled weight decay, the update of torch.optim.AdamW
                (tests/test_step_reference.py checks whole training steps against it); on CPU in fp32 outside a
                sharded layout, FusedAdamW (trainer/fused_adamw.py: kernels/optimizer.cc) where it is built
    adamw_bert  MindSpore's nn.AdamWeightDecay: the same without bias correction (BERT's optimizer)
    came        MindFormers' Came, its weight decay applied here per group (Came itself decays every parameter)

Each optimizer's update count is its `global_step` parameter: it is saved in optimizer.safetensors, so the
schedule and AdamW's bias correction (1 - beta^t) resume exactly. A step skipped for non-finite gradients
does not call the optimizer, so it advances neither.

A native run imports no MindFormers (importing it prints two hyper_parallel warnings): AdamW below and the schedules
are native, equal to MindFormers' classes (tests/test_step.py), and Came is imported only when optim=came.
"""
from typing import List

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import initializer

from base.schema import OptimConfig
from models import deferred_initialisation
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


def build_optimizer(params: List, cfg: OptimConfig, max_steps: int, device_target: str = "CPU",
                    sharded: bool = False) -> nn.Optimizer:
    """The `optim` preset over `params`; `device_target` and `sharded` (the run's device.target and
    base.schema.is_sharded(parallel)) choose AdamW's kernel version where it applies (trainer/fused_adamw.py)."""
    with deferred_initialisation(sharded):  # the moments too: each rank initialises its slices when it compiles
        return _build_optimizer(params, cfg, max_steps, device_target, sharded)


def _build_optimizer(params: List, cfg: OptimConfig, max_steps: int, device_target: str, sharded: bool):
    lr = build_schedule(cfg, max_steps)
    if cfg.name == "adamw":
        from trainer import fused_adamw

        adamw = fused_adamw.FusedAdamW if fused_adamw.applies(params, device_target, sharded) else AdamW
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


_map = ops.HyperMap()  # per parameter: trainer/step.py says why not a Python loop
_scaled = ops.MultitypeFuncGraph("scaled")
_square_sum = ops.MultitypeFuncGraph("square_sum")


@_scaled.register("Tensor", "Tensor")
def _scaled_tensor(factor, grad):
    return grad * factor


# The mark MindSpore's parallel pass looks for (mindspore/ops/function/clip_func.py, MindFormers' ClipGradNorm):
# under tensor/pipeline parallelism or optimizer sharding it all-reduces a square sum so marked over the
# parameter's shards and across the pipeline stages, so the norm is the global one on every rank; without it each
# rank would clip by its own shard's norm. On one device it is a reshape to [1].
_global_square_sum = ops.ExpandDims().add_prim_attr("grad_scale", True)


@_square_sum.register("Tensor")
def _square_sum_tensor(grad):
    """Column sums first, then their sum ([1], marked for the parallel pass above): MindSpore's CPU ReduceSum of a
    whole matrix to a scalar is several times slower than summing its columns and then the resulting vector
    (kernels/probes/mindspore_ops.py)."""
    rows = grad.reshape(-1, grad.shape[-1]) if grad.ndim else grad.reshape(1, 1)
    return _global_square_sum(ops.reduce_sum(ops.reduce_sum(rows * rows, 0)).astype(ms.float32), 0)


class ClippedUpdates:
    """What trainer/step.py ClipAndUpdate calls on every optimizer built here: each gradient's sum of squares (the
    global norm) and the update of the gradients times a factor (1 / the loss scale, times clipping's), here by
    MindSpore's ops; FusedAdamW does both with kernels/optimizer.cc."""

    def square_sums(self, gradients):
        return _map(_square_sum, gradients)

    def scaled_update(self, gradients, factor):
        return self.construct(_map(ops.partial(_scaled, factor), gradients))


class AdamWeightDecay(ClippedUpdates, nn.AdamWeightDecay):
    """MindSpore's AdamWeightDecay (adamw_bert), its state names unchanged."""


_adamw_update = ops.MultitypeFuncGraph("adamw_update")
_fused_adam = ops.AdamWeightDecay()  # one kernel per parameter: m, v and w updated in place in one pass


@_adamw_update.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                        "Tensor")
def _adamw_param(beta1, beta2, lr, eps, decay_scale, weight_decay, param, grad, exp_avg, exp_avg_sq):
    """One parameter's update by MindSpore's fused AdamWeightDecay kernel (w -= lr * (m / (sqrt(v) + eps) + decay * w),
    no bias correction), given the bias-corrected lr and eps and the matching decay (AdamW.construct)."""
    return _fused_adam(param, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay * decay_scale,
                       ops.cast(grad, param.dtype))


class AdamW(ClippedUpdates, nn.Optimizer):
    """torch.optim.AdamW's update (decoupled decay w *= 1 - lr * weight_decay, then the bias-corrected Adam step with
    t = global_step after this update's increment), as MindFormers' `AdamW`: the same update (equal to 1e-6 after 5
    steps, tests/test_step.py; computed by the fused kernel, `construct`) and the same state names (`adam_m.<param>`,
    `adam_v.<param>`, `global_step`), so checkpoints written with MindFormers' class load.
    Weight decay per group (`param_groups`), one learning rate or schedule for all."""

    def __init__(self, params, learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(learning_rate, params, weight_decay=weight_decay)
        self.beta1, self.beta2, self.eps = (Tensor(np.array([v], np.float32)) for v in (*betas, eps))
        self.exp_avg = self.zeros_like_params("adam_m")
        self.exp_avg_sq = self.zeros_like_params("adam_v")

    def zeros_like_params(self, prefix: str) -> ParameterTuple:
        """float32 zeros named `<prefix>.<param>` and laid out (sharded) like their parameter."""
        states = []
        for param in self.parameters:
            state = Parameter(initializer("zeros", param.shape, ms.float32))
            state.param_info = param.param_info.clone()  # its layout for optimizer sharding and checkpoints
            state.name = f"{prefix}.{param.name}"
            if hasattr(param.param_info, "cloned_obj"):
                param.param_info.cloned_obj.append(state)
            else:
                param.param_info.cloned_obj = [state]
            states.append(state)
        return ParameterTuple(states)

    def corrected(self, step):
        """torch's update  w <- w (1 - lr wd) - lr / c1 * m / (sqrt(v / c2) + eps),  c_i = 1 - beta_i^t,  is the
        fused kernels' (no bias correction) with lr' = lr sqrt(c2) / c1, eps' = eps sqrt(c2) and wd' = wd c1 /
        sqrt(c2), so that lr' wd' = lr wd: equal in exact arithmetic, one pass over each parameter instead of ~12
        elementwise kernels. Returns (lr', eps', c1 / sqrt(c2)) for update number `step` (t), lr as the schedule
        gives it before the update count moves."""
        step = ops.cast(step, ms.float32)
        c1 = 1 - ops.pow(self.beta1, step)
        sqrt_c2 = ops.sqrt(1 - ops.pow(self.beta2, step))
        return self.get_lr() * sqrt_c2 / c1, self.eps * sqrt_c2, c1 / sqrt_c2

    def construct(self, gradients):
        """The update of `gradients` by MindSpore's fused kernel per parameter."""
        weight_decay = self.get_weight_decay()
        lr, eps, decay_scale = self.corrected(self.global_step + 1)  # (lr: before the update count moves)
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        update = ops.partial(_adamw_update, self.beta1, self.beta2, lr, eps, decay_scale)
        if self.is_group:
            return self.hyper_map(update, weight_decay, self._parameters, gradients, self.exp_avg, self.exp_avg_sq)
        return self.hyper_map(ops.partial(update, weight_decay), self._parameters, gradients, self.exp_avg,
                              self.exp_avg_sq)


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
