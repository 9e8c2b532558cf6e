"""One optimizer step as two compiled graphs, so gradient accumulation is a plain Python loop:

    for micro_batch in step:  loss = forward_backward(micro_batch, loss_scale)   # grads += d(loss*scale)/dw
    grad_norm, finite, lr = apply_update(loss_scale, n_micro, allow)              # unscale, clip, AdamW, zero

Gradients accumulate in fp32 buffers (like Megatron's main_grad). With fp16 the loss is multiplied by a
dynamic loss scale; a step whose gradients overflow is skipped and the scale backs off (DynamicLossScale).
"""
from dataclasses import dataclass
from typing import Optional

import mindspore as ms
from mindspore import Tensor, nn, ops


class ForwardBackward(nn.Cell):
    def __init__(self, loss_net: nn.Cell, params: ms.ParameterTuple):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.loss_net = loss_net
        self.params = params
        self.grad_buffers = params.clone(prefix="grad_buffer", init="zeros")
        self.value_and_grad = ms.value_and_grad(self.scaled_loss, None, params)

    def scaled_loss(self, input_ids, labels, loss_scale):
        return self.loss_net(input_ids, labels) * loss_scale

    def construct(self, input_ids, labels, loss_scale):
        scaled, grads = self.value_and_grad(input_ids, labels, loss_scale)
        for buffer, grad in zip(self.grad_buffers, grads):
            ops.assign_add(buffer, grad)
        return scaled / loss_scale


class ApplyUpdate(nn.Cell):
    """`reducer` (data parallel) averages the gradients over replicas first, so the finite check, the norm
    and clipping all see the global gradient."""

    def __init__(self, optimizer: nn.Optimizer, grad_buffers: ms.ParameterTuple, clip_grad_norm: float,
                 reducer: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.update = ClipAndUpdate(optimizer, clip_grad_norm)
        self.grad_buffers = grad_buffers
        self.reducer = reducer
        self.reduce = reducer is not None

    def construct(self, loss_scale, n_micro, allow):
        """`allow`=False discards the accumulated gradients (a step the host decided to skip)."""
        grads = [g / (loss_scale * n_micro) for g in self.grad_buffers]
        if self.reduce:
            grads = list(self.reducer(tuple(grads)))
        norm, finite, lr = self.update(grads, allow)
        for buffer in self.grad_buffers:
            ops.assign(buffer, ops.zeros_like(buffer))
        return norm, finite, lr


class ClipAndUpdate(nn.Cell):
    """(norm, finite, lr) = update(grads, allow): the global gradient norm, clipping to `clip_grad_norm`, and
    the optimizer step, taken only when every gradient is finite and `allow` is True."""

    def __init__(self, optimizer: nn.Optimizer, clip_grad_norm: float):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm

    def construct(self, grads, allow):
        finite = ms.amp.all_finite(grads)
        norm = ops.sqrt(ops.addn([ops.reduce_sum(g * g) for g in grads]))
        if self.clip_grad_norm > 0:
            factor = ops.minimum(self.clip_grad_norm / (norm + 1e-6), 1.0)
            grads = [g * factor for g in grads]
        lr = self.optimizer.get_lr()
        if ops.logical_and(finite, allow):
            self.optimizer(tuple(grads))
        return norm, finite, lr


@dataclass
class DynamicLossScale:
    """Host-side dynamic loss scaling: halve on overflow, double after `growth_interval` clean steps."""
    scale: float
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    clean_steps: int = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, 1.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def tensor(self) -> Tensor:
        return Tensor(self.scale, ms.float32)
