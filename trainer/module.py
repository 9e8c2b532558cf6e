"""TrainModule: one optimizer step over an objective's inputs, with the same interface on one device, under
data parallelism and under tensor/pipeline sharding, so the loop (trainer/loop.py) never branches on the
layout (OLMo-core's TrainModule/Trainer split).

    result = module.step(micro_batches, loss_scale, guard)    # forward/backward every micro-batch, update
    val = module.evaluate(batches)                             # token-weighted loss and metrics
    module.save(step_dir_root, step, state, ...) / module.load(path)

`micro_batches` are the step's inputs (tuples of numpy arrays in the objective's `inputs` order); `guard`
(trainer/guard.py SpikeGuard, or None: every finite update is taken) decides on the update: `guard.check(loss)`
is the host's verdict (a reason to skip it, or None), asked between the backward and the update where the step
has two graphs; a one-graph step compares the loss to `guard.limit()` itself, the same verdict.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import Tensor

from adapters.twins import libraries_in, overlay
from base import checkpoint
from evaluation.validation import batch_means, lm_loss_only
from trainer.step import ApplyUpdate, ForwardBackward, TrainStep


def loss_cell(objective, model):
    """The objective's loss cell over `model`, with the kernel twins of its own cells (the token cross-entropy's)
    where the model runs on their kernels/ libraries: the overlay pass the model's build ran, over the cells the
    objective adds (adapters/twins.py)."""
    net = objective.loss_cell(model)
    overlay(net, libraries_in(model))
    return net


def validation_cell(objective, model, net):
    """The loss cell validation runs beside the training one `net`: `net` itself where it adds no auxiliary loss,
    else one reporting the objective's loss alone (evaluation/validation.py lm_loss_only)."""
    return lm_loss_only(loss_cell(objective, model)) if getattr(net, "has_aux", False) else net


@dataclass
class StepResult:
    loss: float  # mean over the step's loss tokens (all micro-batches, all replicas)
    grad_norm: Tensor
    finite: bool  # every gradient finite (False: the update was not applied)
    lr: Tensor
    skip: Optional[str] = None  # why the host skipped the update
    metrics: Dict[str, float] = field(default_factory=dict)  # the objective's, weighted like the loss
    loss_tokens: Optional[int] = None  # tokens that carried loss in the global batch
    seconds: Dict[str, float] = field(default_factory=dict)  # the loop's: making the inputs, the update


class LocalModule:
    """One device, or data parallel (`world_size` replicas, gradients averaged by AllReduce). `one_graph`
    (one micro-batch per step on one device): trainer/step.py TrainStep; else two graphs per step, accumulation a
    Python loop weighted by each micro-batch's loss tokens."""

    def __init__(self, model, objective, optimizer, clip_grad_norm: float, world_size: int = 1, adapters=None,
                 one_graph: bool = False):
        """`adapters`: a PEFT run's base/peft.py Adapters, whose checkpoints hold only those weights."""
        self.model, self.objective, self.optimizer, self.adapters = model, objective, optimizer, adapters
        self.loss_net = loss_cell(objective, model)
        self.eval_net = validation_cell(objective, model, self.loss_net)
        if one_graph:
            assert world_size == 1, "the one-graph step is single-device"
            self.train_step = TrainStep(self.loss_net, optimizer, clip_grad_norm)
            return
        self.train_step = None
        self.forward_backward = ForwardBackward(self.loss_net, optimizer.parameters)
        reducer, self.replica_sum = None, None
        if world_size > 1:
            from distributed.data_parallel import ReplicaSum, gradient_reducer

            reducer, self.replica_sum = gradient_reducer(optimizer.parameters, world_size), ReplicaSum()
        self.world_size = world_size
        self.apply_update = ApplyUpdate(optimizer, self.forward_backward.grad_buffers, clip_grad_norm, reducer)

    def _global_sum(self, values: np.ndarray) -> np.ndarray:
        """`values` summed over the replicas (themselves on one device): one AllReduce for all of them."""
        if self.replica_sum is None:
            return values
        return self.replica_sum(Tensor(values.astype(np.float32))).asnumpy().astype(np.float64)

    def step(self, micro_batches: Sequence[tuple], loss_scale: float, guard=None) -> StepResult:
        if self.train_step is not None:
            return self._one_graph_step(micro_batches, loss_scale, guard)
        counts = [self.objective.loss_tokens(inputs) for inputs in micro_batches]
        local = sum(counts)  # this replica's loss tokens
        outs = []  # read after the loop: one host sync per step, the micro-batches launched back to back
        for inputs, n in zip(micro_batches, counts):
            if n == 0:  # no loss token: nothing to add to the gradient
                continue
            weight = n / local  # the buffers hold this replica's mean gradient; `share` weights it among the replicas
            outs.append((n, self.forward_backward(Tensor(loss_scale * weight, ms.float32), *map(Tensor, inputs))))
        sums = np.zeros(2 + len(self.objective.metrics))  # [loss tokens, token-weighted loss, metrics...]
        sums[0] = local
        for n, out in outs:
            sums[1:] += n * np.array([float(x.asnumpy()) for x in out])
        total, loss, *metrics = self._global_sum(sums)  # every rank decides on the same, global numbers
        total = round(total)  # loss tokens of the global batch (exact in float32 below 2^24)
        loss, metrics = loss / max(total, 1), [m / max(total, 1) for m in metrics]
        skip = guard.check(loss) if guard else None
        share = self.world_size * local / max(total, 1)
        grad_norm, finite, lr = self.apply_update(Tensor(loss_scale, ms.float32), Tensor(skip is None),
                                                  Tensor(share, ms.float32))
        return StepResult(loss, grad_norm, bool(finite.asnumpy()), lr, skip,
                          dict(zip(self.objective.metrics, metrics)), total)

    def _one_graph_step(self, micro_batches: Sequence[tuple], loss_scale: float, guard) -> StepResult:
        (inputs,) = micro_batches
        limit = guard.limit() if guard else np.float32(np.inf)
        *outs, grad_norm, finite, lr = self.train_step(Tensor(loss_scale, ms.float32), Tensor(limit, ms.float32),
                                                       *map(Tensor, inputs))
        loss, *metrics = (float(out.asnumpy()) for out in outs)
        return StepResult(loss, grad_norm, bool(finite.asnumpy()), lr, guard.check(loss) if guard else None,
                          dict(zip(self.objective.metrics, metrics)), self.objective.loss_tokens(inputs))

    def evaluate(self, batches: List[tuple]) -> Tuple[Dict[str, float], int]:
        """(the objective's loss and metrics over `batches`, each batch weighted by its loss tokens; those tokens):
        evaluation/validation.py, which `python -m evaluation` runs too. The loss is the objective's alone: a
        router's auxiliary loss, which the training step adds, is not in it."""
        return batch_means(self.eval_net, self.objective, batches)

    def save(self, root: str, step: int, state: dict, cfg, tokenizer_file: str, is_main: bool) -> None:
        if is_main:
            adapters = self.adapters
            checkpoint.save(root, step, self.model, self.optimizer, state, cfg, tokenizer_file,
                            adapters.names if adapters else None,
                            {"adapter_config.json": adapters.config} if adapters and adapters.config else None)

    def load(self, path: str, example_inputs: Optional[tuple] = None) -> dict:
        """The weights and optimizer state of checkpoint `path` loaded; returns its training state. Local graphs
        compile at their first step, after loading, so `example_inputs` (which ShardedModule.load compiles with
        before it loads its rank's slices) is not needed here."""
        return checkpoint.load(path, self.model, self.optimizer, self.adapters.names if self.adapters else None)


def local_module(model, objective, optimizer, cfg, world_size: int = 1, adapters=None) -> LocalModule:
    """LocalModule as train.py builds it for `cfg`: one graph per step at trainer.grad_accum=1 on one device
    (unless trainer.one_graph_step=false), else two."""
    t = cfg.trainer
    return LocalModule(model, objective, optimizer, cfg.optim.clip_grad_norm, world_size, adapters,
                       one_graph=t.one_graph_step and t.grad_accum == 1 and world_size == 1)


class ShardedModule:
    """Tensor/pipeline parallel or optimizer sharding (Ascend/GPU): the step is one semi-auto graph
    (trainer/step.py ShardedTrainStep under distributed/semi_auto.py), fed the whole pipeline batch at once;
    its loss is not seen before the update, so `guard` is not asked (validation turns spike skipping off).
    Evaluation runs the loss cell's forward under the same layout (semi_auto.parallel_evaluation): no rank
    holds or builds more than its slices. Only the last pipeline stage computes the loss: the step's outputs
    are taken from its ranks (`last_stage_values`)."""

    def __init__(self, model, objective, optimizer, cfg, rank: int, run_dir: str):
        from distributed.semi_auto import parallel_evaluation, parallel_step, shard_model
        from planner.layout import Layout
        from trainer.step import PipelinedLoss, ShardedTrainStep

        self.model, self.objective, self.optimizer, self.rank, self.run_dir = model, objective, optimizer, rank, run_dir
        parallel = cfg.parallel
        self.dp, self.pp = parallel.dp, parallel.pp
        self.stage = Layout.from_config(parallel, cfg.model.num_layers).coords(rank).pp
        loss_net = loss_cell(objective, model)
        shard_model(model, cfg)
        self.train_step = ShardedTrainStep(loss_net, optimizer, cfg.optim.clip_grad_norm, parallel.pp,
                                           parallel.micro_batches, parallel.optimizer_shard)
        self.compiled = parallel_step(self.train_step, cfg, run_dir, rank)
        self.eval_micro_batches = parallel.micro_batches if parallel.pp > 1 else 1  # PipelinedLoss sums their outputs
        eval_net = validation_cell(objective, model, loss_net)
        self.evaluation = parallel_evaluation(
            PipelinedLoss(eval_net, parallel.micro_batches) if parallel.pp > 1 else eval_net, cfg)
        self.fed = set()  # the graphs whose dataset strategy is set
        self.loss_scale = 1.0  # the value train_step.loss_scale holds, kept here: no device read per step

    def _feed(self, graph, inputs: tuple) -> None:
        """Set `graph`'s dataset strategy from the first batch it gets (semi_auto.batch_strategy)."""
        from distributed.semi_auto import feed

        if id(graph) not in self.fed:
            feed(graph, inputs, self.dp)
            self.fed.add(id(graph))

    def step(self, micro_batches: Sequence[tuple], loss_scale: float, guard=None) -> StepResult:
        (inputs,) = micro_batches  # validation: grad_accum == 1; the pipeline's micro-batches are in the batch
        self._feed(self.compiled, inputs)
        if loss_scale != self.loss_scale:  # (NaN, an injected fault, is set every time)
            self.train_step.loss_scale.set_data(Tensor(loss_scale, ms.float32))
            self.loss_scale = loss_scale
        *outs, grad_norm, finite, lr = self.compiled(*map(Tensor, inputs))
        loss, *metrics = last_stage_values([float(out.asnumpy()) for out in outs], self.stage == self.pp - 1,
                                           self.pp)
        return StepResult(loss, grad_norm, bool(finite.asnumpy()), lr, metrics=dict(zip(self.objective.metrics, metrics)))

    def evaluate(self, batches: List[tuple]) -> Tuple[Dict[str, float], int]:
        """As LocalModule.evaluate, through the sharded forward graph (pipeline outputs summed over the
        micro-batches, hence divided by their count)."""
        def forward(*inputs):
            self._feed(self.evaluation, inputs)
            return tuple(out / self.eval_micro_batches for out in self.evaluation(*inputs))

        return batch_means(forward, self.objective, batches)

    def save(self, root: str, step: int, state: dict, cfg, tokenizer_file: str, is_main: bool) -> None:
        """Every rank writes its slices; once all have (a barrier over the run, every node), rank 0 writes state.json
        and moves `latest`, what a resume looks for: `latest` never names a step with a rank's slice still
        missing (a node that dies mid-save leaves the previous `latest`)."""
        import os

        from distributed.semi_auto import barrier, save_rank_slices

        step_dir = os.path.join(root, f"step_{step:06d}")
        save_rank_slices(step_dir, self.train_step, self.rank, self.run_dir)
        barrier()
        if is_main:
            checkpoint.write_metadata(step_dir, step, state, cfg, tokenizer_file)
            checkpoint.set_latest(root, step_dir)

    def load(self, path: str, example_inputs: tuple) -> dict:
        from distributed.semi_auto import load_rank_slices

        state = checkpoint.read_state(path)
        self._feed(self.compiled, example_inputs)
        load_rank_slices(path, self.compiled, self.rank, tuple(map(Tensor, example_inputs)))
        return state


def last_stage_values(values: List[float], on_last_stage: bool, pp: int, all_reduce=None) -> List[float]:
    """A pipelined step's outputs as the last stage computed them, on every rank: only that stage runs the loss
    cell (the other stages' outputs mean nothing, as MindFormers' loss callback warns), so the world sums each
    value times "this rank is on the last stage" and divides by the last stage's rank count (its ranks hold the
    same, global values). `all_reduce` (a sum over the world; MindSpore's by default) is a parameter for tests."""
    if pp == 1:
        return values
    if all_reduce is None:
        from mindspore.communication.comm_func import all_reduce as world_sum

        all_reduce = lambda array: world_sum(Tensor(array))[0].asnumpy()
    sums = all_reduce(np.array(values + [1.0], np.float32) * float(on_last_stage))
    return [float(value) / float(sums[-1]) for value in sums[:-1]]
