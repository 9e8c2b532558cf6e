"""Learning-rate schedules as functions of the optimizer's update count `global_step` (int32, 0 for the first update).

Written natively so that a training run never imports MindFormers (importing it prints two hyper_parallel
warnings); each is MindFormers 1.9's class of the same role (mindformers/core/lr/lr_schedule.py) with its
arithmetic in the same float32 order, so the values are equal step for step (tests/test_step.py checks all steps):

    WarmupCosine       CosineWithWarmUpLR: linear warmup from 0, then min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
                       over the remaining steps; min_lr from total_steps on
    WarmupStableDecay  WarmUpStableDecayLR: linear warmup from 0, lr until decay_start, then linear to min_lr
                       at total_steps (MindFormers computes the stable lr as lr * t / t, NaN at t = 0 when warmup
                       is 0; here it is lr)
    WarmupConstant     ConstantWarmUpLR: linear warmup from 0, then lr

Warmup: lr * t / warmup for t < warmup, so the first update (t = 0) has lr 0 when warmup > 0.
"""
import math

import mindspore as ms
from mindspore import Tensor, nn, ops


class WarmupConstant(nn.learning_rate_schedule.LearningRateSchedule):
    def __init__(self, lr: float, warmup: int):
        super().__init__()
        self.lr = lr
        self.warmup = Tensor(warmup, ms.float32)

    def warming_up(self, step):
        return self.warmup != 0 and self.warmup > step

    def construct(self, global_step):
        step = ops.cast(global_step, ms.float32)
        if self.warming_up(step):
            return self.lr * (step / self.warmup)
        return step - step + self.lr


class WarmupCosine(WarmupConstant):
    def __init__(self, lr: float, warmup: int, total_steps: int, min_lr: float):
        super().__init__(lr, warmup)
        self.min_lr = Tensor(min_lr, ms.float32)
        self.cosine_steps = Tensor(max(1, total_steps - warmup), ms.float32)
        self.total_steps = Tensor(max(1, total_steps), ms.float32)

    def construct(self, global_step):
        step = ops.cast(global_step, ms.float32)
        if step >= self.total_steps:
            return step - step + self.min_lr
        if self.warming_up(step):
            return self.lr * (step / self.warmup)
        progress = (step - self.warmup) / self.cosine_steps
        percent = ops.maximum(Tensor(0.0, ms.float32), 0.5 * (1.0 + ops.cos(math.pi * progress)))
        return self.min_lr + (self.lr - self.min_lr) * percent


class WarmupStableDecay(WarmupConstant):
    def __init__(self, lr: float, warmup: int, total_steps: int, decay_start: int, min_lr: float):
        super().__init__(lr, warmup)
        self.min_lr = Tensor(min_lr, ms.float32)
        self.decay_start = Tensor(decay_start, ms.float32)
        self.decay_steps = Tensor(total_steps - decay_start, ms.float32)

    def construct(self, global_step):
        step = ops.cast(global_step, ms.float32)
        if self.warming_up(step):
            return self.lr * (step / self.warmup)
        if self.decay_start > step:
            return step - step + self.lr
        percent = (step - self.decay_start) / self.decay_steps
        return self.lr - (self.lr - self.min_lr) * percent
