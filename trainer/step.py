"""The compiled cells of one optimizer step. Each takes the objective's inputs as `*inputs` (the batch's
named columns in the objective's order), so a new objective needs no new step code.

One micro-batch on one device (trainer.grad_accum=1, no data parallelism), one graph:

    loss, *metrics, grad_norm, finite, lr = train_step(loss_scale, limit, *inputs)   # TrainStep

forward, backward, unscale, clip and AdamW, the update taken when the gradients are finite and the loss is at
most `limit` (the host's spike threshold, trainer/guard.py SpikeGuard.limit): no gradient buffers to fill and
zero (their AssignAdd and Assign kernels were ~37 ms of a ~2.3 s model=small step on a 2-core box, by MindSpore's
CPU profiler) and one host round trip instead of two. trainer.one_graph_step=false keeps two graphs.

Gradient accumulation and data parallelism, two graphs, so accumulation is a plain Python loop:

    for inputs, weight in micro_batches:  loss, *metrics = forward_backward(loss_scale * weight, *inputs)
    grad_norm, finite, lr = apply_update(loss_scale, allow, share)  # (all-reduce,) unscale, clip, AdamW, zero

`weight` is the micro-batch's share of this replica's loss tokens and `share` the replica's share of the global
batch's (trainer/module.py computes both on the host from the batches and one all-reduce of the counts), so the
gradient is that of the mean loss over every loss token of the step: right even when micro-batches or replicas
hold different numbers of loss tokens (SFT, MLM), where a mean of micro-batch means would not be.
Gradients accumulate in fp32 buffers (like Megatron's main_grad). With fp16 the loss is multiplied by a
dynamic loss scale; a step whose gradients overflow is skipped and the scale backs off (DynamicLossScale).

Tensor/pipeline parallel (Ascend/GPU): ShardedTrainStep does forward, backward, gradient reduction, clipping
and the update in one graph, as MindSpore's pipeline pass needs; distributed/semi_auto.py compiles it. Its
clipping norm is the global one: each gradient's square sum ends in the `grad_scale`-marked ExpandDims of
trainer/optimizer.py, for which MindSpore's parallel pass sums the square sums over the tensor-parallel shards,
the optimizer shards and the pipeline stages; the finite check reads that norm, so every rank decides alike.
"""
from dataclasses import dataclass
from typing import Optional

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.parallel.nn import Pipeline, PipelineGradReducer
from mindspore.parallel.nn.parallel_grad_reducer import grad_scale, shard_grad_scale

from models import deferred_initialisation

# Per-parameter arithmetic goes through HyperMap: graph mode unrolls a Python loop over the ~75 parameters of
# model=small into ~75 copies of its body, parsed and specialized one by one (ApplyUpdate took 15 s to compile
# that way; benchmarks/memory_timeline.py), while a HyperMap over same-typed tensors is specialized once.
_map = ops.HyperMap()
_accumulate = ops.MultitypeFuncGraph("accumulate")
_zero = ops.MultitypeFuncGraph("zero")


@_accumulate.register("Tensor", "Tensor")
def _accumulate_tensor(buffer, grad):
    return ops.assign_add(buffer, grad)


@_zero.register("Tensor")
def _zero_tensor(buffer):
    return ops.assign(buffer, ops.zeros_like(buffer))


_scale = ops.MultitypeFuncGraph("scale")


@_scale.register("Tensor", "Tensor")
def _scale_tensor(factor, grad):
    return grad * factor.astype(grad.dtype)


class ScaledLossGradients(nn.Cell):
    """What every step cell differentiates: `self.value_and_grad(scale, *inputs)` gives ((loss * scale, loss,
    *metrics), d(loss * scale)/d params) for the loss cell's outputs (loss, *metrics)."""

    def __init__(self, loss_net: nn.Cell, params: ms.ParameterTuple):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.loss_net = loss_net
        self.value_and_grad = ms.value_and_grad(self.scaled_loss, None, params, has_aux=True)

    def scaled_loss(self, scale, *inputs):
        """(loss * scale: what is differentiated, then the loss cell's outputs as auxiliaries)."""
        out = self.loss_net(*inputs)
        return (out[0] * scale,) + out


class ForwardBackward(ScaledLossGradients):
    """(loss, *metrics) = forward_backward(scale, *inputs), adding d(loss * scale)/dw to the grad buffers."""

    def __init__(self, loss_net: nn.Cell, params: ms.ParameterTuple):
        super().__init__(loss_net, params)
        self.params = params
        self.grad_buffers = params.clone(prefix="grad_buffer", init="zeros")

    def construct(self, scale, *inputs):
        out, grads = self.value_and_grad(scale, *inputs)
        out = ops.depend(out, _map(_accumulate, self.grad_buffers, grads))
        return (out[0] / scale,) + out[2:]  # a NaN scale (trainer.inject_nan_steps) makes a NaN loss


class ApplyUpdate(nn.Cell):
    """`reducer` (data parallel) averages the gradients over replicas first, so the finite check, the norm
    and clipping all see the global gradient. Each replica's buffers hold the mean gradient over its own loss
    tokens; `share` (world size x its tokens / the global batch's) weights it in that average, so the result is the
    mean over every loss token of the step, however unevenly the replicas' batches hold them."""

    def __init__(self, optimizer: nn.Optimizer, grad_buffers: ms.ParameterTuple, clip_grad_norm: float,
                 reducer: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.update = ClipAndUpdate(optimizer, clip_grad_norm)
        self.grad_buffers = grad_buffers
        self.reducer = reducer
        self.reduce = reducer is not None

    def construct(self, loss_scale, allow, share=None):
        """`allow`=False discards the accumulated gradients (a step the host decided to skip); `share` is read
        under data parallelism only."""
        grads = self.grad_buffers
        if self.reduce:
            grads = self.reducer(_map(ops.partial(_scale, share), grads))
        norm, finite, lr = self.update(grads, allow, 1.0 / loss_scale)
        norm = ops.depend(norm, _map(_zero, self.grad_buffers))
        return norm, finite, lr


class TrainStep(ScaledLossGradients):
    """(loss, *metrics, norm, finite, lr) = step(loss_scale, limit, *inputs): one micro-batch's forward and
    backward and the update in one graph; the update is skipped unless the loss is finite and <= `limit`."""

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Optimizer, clip_grad_norm: float):
        super().__init__(loss_net, optimizer.parameters)
        self.update = ClipAndUpdate(optimizer, clip_grad_norm)

    def construct(self, loss_scale, limit, *inputs):
        out, grads = self.value_and_grad(loss_scale, *inputs)
        loss = out[0] / loss_scale  # a NaN scale (trainer.inject_nan_steps) makes a NaN loss
        allow = ops.logical_and(ops.isfinite(loss), loss <= limit)
        norm, finite, lr = self.update(grads, allow, 1.0 / loss_scale)
        return (loss,) + out[2:] + (norm, finite, lr)


class ClipAndUpdate(nn.Cell):
    """(norm, finite, lr) = update(grads, allow, unscale): the global norm of grads * unscale, clipping to
    `clip_grad_norm`, and the optimizer step, taken only when every gradient is finite and `allow` is True. A NaN
    or inf in any gradient makes the norm NaN or inf, so `finite` is read off the norm (as Megatron does) instead
    of a second pass over every gradient; a norm that overflows float32 (all gradients finite) also counts as
    non-finite."""

    def __init__(self, optimizer: nn.Optimizer, clip_grad_norm: float):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm

    def construct(self, grads, allow, unscale):
        """`grads` times `unscale` (1 / the loss scale) are the gradients: the optimizer takes that product and
        clipping's as one factor (trainer/optimizer.py ClippedUpdates: its square sums and its scaled update)."""
        norm = ops.sqrt(ops.addn(self.optimizer.square_sums(grads))).reshape(()) * unscale
        finite = ops.isfinite(norm)
        factor = unscale
        if self.clip_grad_norm > 0:
            factor = ops.minimum(self.clip_grad_norm / (norm + 1e-6), 1.0) * unscale
        lr = self.optimizer.get_lr()
        if ops.logical_and(finite, allow):
            self.optimizer.scaled_update(grads, factor)
        return norm, finite, lr


class PipelinedLoss(Pipeline):
    """MindSpore's `Pipeline` for a loss cell that returns a tuple (loss, *metrics): the batch cut into
    `micro_size` micro-batches, each output summed over them by that micro-batch's `pipeline_end` Add, as
    MindFormers' PipelineCellWithMultiOutputs does. `Pipeline.construct` adds whole outputs with one Add, which
    takes tensors, not tuples: "Failed calling Add with input=Tuple[Tensor]" at compile. The sums are of
    micro-batch means; ShardedTrainStep divides by the micro-batch count."""

    def construct(self, *inputs):
        total = None
        for i in range(self.micro_size):
            out = self.network(*self.micro_inputs[i](i, *inputs))
            total = out if total is None else _map(self.add_list[i], total, out)
        return total


class PipelineGradients(PipelineGradReducer):
    """The pipeline's accumulated gradients: MindSpore's pipeline pass adds every micro-batch's gradient into
    the `accu_grads.*` buffers this cell holds; it reads them and zeroes them for the next step (with optimizer
    sharding each rank's gradient slice comes out of the backward already accumulated: the buffers are only
    zeroed). MindSpore 2.9's own `construct` reads `grads` in the branch without optimizer sharding before it is
    assigned (NameError at compile); this is that method with the branch fixed, as MindFormers'
    MFPipelineWithLossScaleCell computes it. Unscaling and clipping stay in ClipAndUpdate."""

    def construct(self, grads):
        scale = self.scale_sense * self.degree
        if self.opt_shard:
            return self.hyper_map(ops.partial(shard_grad_scale, scale), grads, self.accu_grads)
        return self.hyper_map(ops.partial(grad_scale, scale), grads, self.grad_reducer(self.accu_grads))


class ShardedTrainStep(TrainStep):
    """One optimizer step in one graph: (loss, *metrics, grad_norm, finite, lr) = step(*inputs), the loss
    scale a parameter (`loss_scale`, set by the host) so that every input of the graph is a batch column
    (distributed/semi_auto.py gives each the dataset strategy (dp, 1, ...)).

    With pp > 1 the batch is split into `micro_batches` micro-batches (1F1B) by PipelinedLoss, which sums the
    micro-batches' losses; the sensitivity and the outputs are divided by their count, so the gradient and the
    loss are the mean over micro-batches (MindFormers divides the same way), not their sum. PipelineGradients
    reads the gradients the pipeline accumulated (they are the accumulation: validation requires
    trainer.grad_accum=1). The mean is of micro-batch means: the loss-token weighting of the two-graph step is
    not applied inside a pipeline. Only the last stage computes the loss: trainer/module.py ShardedModule
    reports that stage's outputs.
    """

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Optimizer, clip_grad_norm: float, pp: int,
                 micro_batches: int, optimizer_shard: bool):
        pipelined = pp > 1
        super().__init__(PipelinedLoss(loss_net, micro_batches) if pipelined else loss_net, optimizer,
                         clip_grad_norm)
        self.micro_batches = micro_batches if pipelined else 1
        self.pipelined = pipelined
        self.allow = ms.Tensor(True)
        self.loss_scale = ms.Parameter(Tensor(1.0, ms.float32), name="loss_scale", requires_grad=False)
        with deferred_initialisation(True):  # the accumulation buffers: each rank's slices, made when it compiles
            self.reducer = PipelineGradients(optimizer.parameters, opt_shard=optimizer_shard) if pipelined else None

    def construct(self, *inputs):
        out, grads = self.value_and_grad(self.loss_scale / self.micro_batches, *inputs)
        if self.pipelined:
            grads = self.reducer(grads)
        norm, finite, lr = self.update(grads, self.allow, 1.0 / self.loss_scale)
        return tuple(value / self.micro_batches for value in out[1:]) + (norm, finite, lr)


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
