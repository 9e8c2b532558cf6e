"""Token cross-entropy with a hand-written gradient, so no more than one [tokens, vocab] fp32 array is alive at
a time besides the logits themselves.

MindSpore's autodiff of `-gather_elements(log_softmax(logits), targets)` keeps log_softmax's output for the
backward and builds the gather's gradient as a dense zeros [tokens, vocab] array plus a scatter, then
log_softmax's gradient (two more arrays). Here the forward keeps only its inputs, and the backward is the
textbook d nll / d logits = softmax(logits) - onehot(target), scaled by each row's weight: one softmax, then
the target column corrected in place of a one-hot.

On CPU in fp32, with the model's layer kernels on, its twin KernelCrossEntropy computes the per-row nll by
kernels/layers.cc instead: the forward one pass per row keeping each row's logsumexp, the backward writing that same
gradient in one pass, where the ops above take ~10 kernels over [tokens, vocab] arrays (the largest arrays of a step
at a 32000-token vocabulary). The twin is registered with adapters/twins.py under the "layers" library, and swapped
into a loss cell by the same pass as the model's twins (trainer/module.py: the loss cell takes the libraries its
model runs on).
"""
import mindspore as ms
from mindspore import nn, ops

from adapters import twins


class TokenNLL(nn.Cell):
    """-log softmax(logits[i])[targets[i]] per row [N] for logits [N, V] fp32 and targets [N] int32 (any value
    where the weight is 0, e.g. a masked position's 0), its gradient (softmax - onehot(target)) x each row's."""

    def __init__(self):
        super().__init__()
        self.softmax = ops.Softmax(-1)
        self.tile = ops.Tile()

    def construct(self, logits, targets):
        return -ops.gather_elements(ops.log_softmax(logits, -1), 1, targets.reshape(-1, 1)).reshape(-1)

    def bprop(self, logits, targets, out, dout):
        row = dout.reshape(-1, 1)
        grad = self.softmax(logits) * self.tile(row, (1, logits.shape[-1]))  # faster than broadcast_to on CPU
        grad = ops.tensor_scatter_elements(grad, targets.reshape(-1, 1), -row, axis=1, reduction="add")
        return grad, ops.zeros_like(targets)


class WeightedCrossEntropy(nn.Cell):
    """sum_i weights[i] * nll_i for logits [N, V] fp32, targets [N] int32, weights [N] fp32 (not differentiated):
    autodiff differentiates the weighted sum, `nll`'s own gradient the per-row nll."""

    def __init__(self):
        super().__init__()
        self.nll = TokenNLL()

    def construct(self, logits, targets, weights):
        return (self.nll(logits, targets) * weights).sum()


class KernelCrossEntropy(WeightedCrossEntropy):
    """The per-row nll by kernels/layers.cc (CrossEntropyKernel, with its own backward)."""

    def __init__(self, base: WeightedCrossEntropy):
        from kernels.layers import CrossEntropyKernel

        twins.adopt(self, base)
        self.nll = CrossEntropyKernel()


twins.register("layers", WeightedCrossEntropy, KernelCrossEntropy)


def masked_mean_nll(cross_entropy: WeightedCrossEntropy, logits, targets, ignore_index: int):
    """(mean nll over the rows whose target is not `ignore_index`, those rows as a float mask [N], their count
    (at least 1)) for logits [N, V] fp32 and targets [N]."""
    counted = targets != ignore_index
    mask = counted.astype(ms.float32)
    n = ops.maximum(mask.sum(), 1.0)
    safe = ops.select(counted, targets, ops.zeros_like(targets))
    return cross_entropy(logits, safe, mask) / n, mask, n
