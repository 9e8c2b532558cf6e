"""AdamW and what every optimizer of trainer/optimizer.py offers the step (ClippedUpdates): a module of its own
because both trainer/optimizer.py (which builds the presets) and trainer/fused_adamw.py (AdamW's kernel version)
need them.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import initializer


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
    """What trainer/step.py ClipAndUpdate calls on every optimizer trainer/optimizer.py builds: each gradient's sum
    of squares (the global norm) and the update of the gradients times a factor (1 / the loss scale, times
    clipping's), here by MindSpore's ops; FusedAdamW does both with kernels/optimizer.cc."""

    def square_sums(self, gradients):
        return _map(_square_sum, gradients)

    def scaled_update(self, gradients, factor):
        return self.construct(_map(ops.partial(_scaled, factor), gradients))


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
