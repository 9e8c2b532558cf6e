"""Data parallelism: one process per replica (started by msrun), gradients averaged by AllReduce.

On CPU the collective backend is mccl; on Ascend HCCL and on GPU NCCL — `communication.init()` picks it.
The model and optimizer are unchanged: identical initial weights (numpy init from one seed) plus averaged
gradients keep the replicas bit-identical.
"""
import mindspore as ms
from mindspore import nn, ops


def init_data_parallel(world_size: int) -> int:
    """Join the process group and switch MindSpore to data-parallel mode; returns this process's rank."""
    from mindspore.communication import get_rank, init

    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world_size)
    return get_rank()


def gradient_reducer(params, world_size: int) -> nn.Cell:
    """Averages a tuple of gradients over the replicas (one fused AllReduce per bucket)."""
    return nn.DistributedGradReducer(params, mean=True, degree=world_size)


class ReplicaSum(nn.Cell):
    """The sum of a vector over the replicas: a step's loss-token count, loss and metrics in one AllReduce (one
    host round trip a step, not one per number)."""

    def __init__(self):
        super().__init__()
        self.all_reduce = ops.AllReduce()

    def construct(self, x):
        return self.all_reduce(x)


def weights_digest(model: nn.Cell) -> str:
    """SHA-256 over all weights: equal on every replica when data parallelism is working."""
    import hashlib

    digest = hashlib.sha256()
    for param in sorted(model.trainable_params(), key=lambda p: p.name):
        digest.update(param.asnumpy().tobytes())
    return digest.hexdigest()
