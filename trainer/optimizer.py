"""The optimizer presets (conf/optim/<name>.yaml) with per-group weight decay, and their learning-rate schedule
(trainer/schedules.py).

    adamw       AdamW below: bias-corrected moments and decoupled weight decay, the update of torch.optim.AdamW
                (tests/test_step_reference.py checks whole training steps against it); on CPU by
                kernels/optimizer.cc where it is built
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


def adamw_kernel_applies(params: List) -> bool:
    """AdamW by kernels/optimizer.cc: on CPU, with fp32 parameters, where scripts/venv.sh built it (else MindSpore's
    fused kernel, the same update)."""
    import kernels

    return (ms.get_context("device_target") == "CPU" and all(p.dtype == ms.float32 for p in params)
            and kernels.library("optimizer")[0] is not None)


def build_optimizer(params: List, cfg: OptimConfig, max_steps: int) -> nn.Optimizer:
    lr = build_schedule(cfg, max_steps)
    if cfg.name == "adamw":
        return AdamW(param_groups(params, cfg), learning_rate=lr, betas=tuple(cfg.betas), eps=cfg.eps,
                     kernel=adamw_kernel_applies(params))
    if cfg.name == "adamw_bert":
        beta1, beta2 = cfg.betas
        return nn.AdamWeightDecay(param_groups(params, cfg), learning_rate=lr, beta1=beta1, beta2=beta2, eps=cfg.eps)
    if cfg.name == "came":
        from mindformers.core.optim import Came  # MindFormers (and its import warnings) only when chosen

        came = Came(params, learning_rate=lr, eps=(cfg.eps[0], 1e-3, cfg.eps[1]), clip_threshold=cfg.clip_threshold,
                    decay_rate=cfg.decay_rate, beta1=cfg.beta1, beta3=cfg.beta3)
        return GroupWeightDecay(came, [p for p in params if decays(p.name, cfg)], cfg.weight_decay)
    raise ValueError(f"optim.name={cfg.name!r} has no builder (base/validate.py admits only buildable ones)")


_adamw_update = ops.MultitypeFuncGraph("adamw_update")
_fused_adam = ops.AdamWeightDecay()  # one kernel per parameter: m, v and w updated in place in one pass


@_adamw_update.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                        "Tensor")
def _adamw_param(beta1, beta2, lr, eps, decay_scale, weight_decay, param, grad, exp_avg, exp_avg_sq):
    """One parameter's update by MindSpore's fused AdamWeightDecay kernel (w -= lr * (m / (sqrt(v) + eps) + decay * w),
    no bias correction), given the bias-corrected lr and eps and the matching decay (AdamW.construct)."""
    return _fused_adam(param, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay * decay_scale,
                       ops.cast(grad, param.dtype))


_compiled = {}  # "adamw": kernels/optimizer.py's op, made by the first AdamW that uses it (read at graph compile)


class AdamW(nn.Optimizer):
    """torch.optim.AdamW's update (decoupled decay w *= 1 - lr * weight_decay, then the bias-corrected Adam step with
    t = global_step after this update's increment), as MindFormers' `AdamW`: the same update (equal to 1e-6 after 5
    steps, tests/test_step.py; computed by the fused kernel, `construct`) and the same state names (`adam_m.<param>`,
    `adam_v.<param>`, `global_step`), so checkpoints written with MindFormers' class load.
    Weight decay per group (`param_groups`), one learning rate or schedule for all."""

    def __init__(self, params, learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, kernel=False):
        """`kernel`: update by kernels/optimizer.cc (built, CPU, fp32 parameters) instead of MindSpore's kernel."""
        super().__init__(learning_rate, params, weight_decay=weight_decay)
        self.kernel = kernel
        if kernel:
            if "adamw" not in _compiled:
                from kernels.optimizer import adamw_op

                _compiled["adamw"] = adamw_op()
            decays = self.group_weight_decay if self.is_group else [weight_decay] * len(self.parameters)
            self.decays = Tensor(np.array(decays, np.float32))  # each parameter's weight decay
            self.one = Tensor(1.0, ms.float32)
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
        """The update of `gradients`: scaled_update's by kernels/optimizer.cc, else MindSpore's fused kernel per
        parameter."""
        if self.kernel:
            return self.scaled_update(gradients, self.one)
        weight_decay = self.get_weight_decay()
        lr, eps, decay_scale = self.corrected(self.global_step + 1)  # (lr: before the update count moves)
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        update = ops.partial(_adamw_update, self.beta1, self.beta2, lr, eps, decay_scale)
        if self.is_group:
            return self.hyper_map(update, weight_decay, self._parameters, gradients, self.exp_avg, self.exp_avg_sq)
        return self.hyper_map(ops.partial(update, weight_decay), self._parameters, gradients, self.exp_avg,
                              self.exp_avg_sq)

    def scaled_update(self, gradients, factor):
        """The update of `gradients` x `factor` (1 / loss scale x clipping's: trainer/step.py ClipAndUpdate) by
        kernels/optimizer.cc's one op over every parameter, where the graph had the product and the fused kernel
        per parameter."""
        lr, eps, decay_scale = self.corrected(self.global_step + 1)
        hyper = ops.concat((lr.reshape(1), self.beta1, self.beta2, eps, decay_scale, factor.reshape(1)))
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        return _compiled["adamw"](hyper, self.decays, *self._parameters, *self.exp_avg, *self.exp_avg_sq,
                                  *gradients)


class GroupWeightDecay(nn.Cell):
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
