"""AdamW by kernels/optimizer.cc (CPU, fp32): the same update as trainer/adamw.py AdamW, whose state it keeps
under the same names (`adam_m.<param>`, `adam_v.<param>`, `global_step`: checkpoints load into either class), in
one op over every parameter, and the gradient norm's square sums by the same library.

build_optimizer chooses it (`applies`) from the run's config: on CPU, outside a sharded layout (each op runs over
whole parameters), with fp32 parameters, where the library is built and not switched off (kernels.library).
trainer/step.py ClipAndUpdate calls the norm, then the update inside the branch taken when the step is allowed,
as MindSpore's own optimizers are called (kernels/optimizer.py says why it is called that way).
"""
from typing import List

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

import kernels
from base.schema import as_device
from trainer.adamw import AdamW


def applies(params: List, device, sharded: bool) -> bool:
    """Whether FusedAdamW updates `params` in a run on `device` (a preset that runs mindlab's kernels/:
    device.cpu_kernels, or a target naming one; `sharded`: a semi-auto layout)."""
    return (as_device(device).cpu_kernels and not sharded and all(p.dtype == ms.float32 for p in params)
            and kernels.library("optimizer")[0] is not None)


class FusedAdamW(AdamW):
    """AdamW whose update takes the gradients' factor (1 / loss scale x clipping's) itself: one pass over each
    parameter where the plain step had the product, then the fused kernel per parameter."""

    def __init__(self, params, learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        from kernels.optimizer import adamw_op, square_sum_op

        super().__init__(params, learning_rate, betas, eps, weight_decay)
        decays = self.group_weight_decay if self.is_group else [weight_decay] * len(self.parameters)
        self.decays = Tensor(np.array(decays, np.float32))  # each parameter's weight decay
        self.one = Tensor(1.0, ms.float32)
        self.square_sum, self.adamw = square_sum_op(), adamw_op()

    def square_sums(self, gradients):
        """One op per gradient, each sum [1] (one op over all of them: kernels/optimizer.py says why not)."""
        return self.hyper_map(self.square_sum, gradients)

    def construct(self, gradients):
        return self.scaled_update(gradients, self.one)

    def scaled_update(self, gradients, factor):
        lr, eps, decay_scale = self.corrected(self.global_step + 1)
        hyper = ops.concat((lr.reshape(1), self.beta1, self.beta2, eps, decay_scale, factor.reshape(1)))
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        return self.adamw(hyper, self.decays, *self._parameters, *self.exp_avg, *self.exp_avg_sq, *gradients)
