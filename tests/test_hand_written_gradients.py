"""The hand-written gradients (objectives/_cross_entropy.py, models/llama/device_ops.py Softmax) equal autodiff's and
PyTorch's: they exist only to keep MindSpore's CPU kernels from holding memory, never to change a number."""
import numpy as np
import pytest

import mindspore as ms
import torch
from mindspore import Tensor, nn, ops

from models.llama.device_ops import Softmax
from objectives._cross_entropy import WeightedCrossEntropy, masked_mean_nll

IGNORE = -100


class MaskedMeanNLL(nn.Cell):
    def __init__(self):
        super().__init__()
        self.cross_entropy = WeightedCrossEntropy()

    def construct(self, logits, targets):
        return masked_mean_nll(self.cross_entropy, logits, targets, IGNORE)[0]


class AutodiffReference(nn.Cell):
    """The plain path the objectives used before: log_softmax + gather_elements, differentiated by MindSpore."""

    def construct(self, logits, targets):
        counted = targets != IGNORE
        mask = counted.astype(ms.float32)
        safe = ops.select(counted, targets, ops.zeros_like(targets))
        nll = -ops.gather_elements(ops.log_softmax(logits, -1), 1, safe.reshape(-1, 1)).reshape(-1)
        return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)


def random_case(n=37, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, (n, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, n).astype(np.int32)
    targets[::5] = IGNORE  # ignored rows: no loss, zero gradient
    return logits, targets


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_loss_and_gradient_equal_torch_and_the_autodiff_path(mode):
    logits, targets = random_case()
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        loss, grad = ms.value_and_grad(MaskedMeanNLL(), 0)(Tensor(logits), Tensor(targets))
        ref_loss, ref_grad = ms.value_and_grad(AutodiffReference(), 0)(Tensor(logits), Tensor(targets))
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    x = torch.tensor(logits, requires_grad=True)
    expected = torch.nn.functional.cross_entropy(x, torch.tensor(targets, dtype=torch.long), ignore_index=IGNORE)
    expected.backward()
    assert float(loss.asnumpy()) == pytest.approx(expected.item(), rel=1e-6)
    np.testing.assert_allclose(grad.asnumpy(), x.grad.numpy(), atol=1e-7)
    np.testing.assert_allclose(grad.asnumpy(), ref_grad.asnumpy(), atol=1e-7)
    assert float(ref_loss.asnumpy()) == pytest.approx(float(loss.asnumpy()), rel=1e-6)
    assert not grad.asnumpy()[::5].any()  # ignored rows get no gradient


def test_every_row_ignored_gives_zero_loss_and_gradient():
    logits, targets = random_case(n=6)
    targets[:] = IGNORE
    loss, grad = ms.value_and_grad(MaskedMeanNLL(), 0)(Tensor(logits), Tensor(targets))
    assert float(loss.asnumpy()) == 0.0
    assert not grad.asnumpy().any()


class WeightedSoftmax(nn.Cell):
    """sum(softmax(x) * w): a scalar whose gradient flows through every softmax output."""

    def __init__(self, softmax):
        super().__init__()
        self.softmax = softmax

    def construct(self, x, w):
        return (self.softmax(x) * w).sum()


class PlainSoftmax(nn.Cell):
    def construct(self, x):
        return ops.softmax(x, -1)


def test_attention_softmax_gradient_equals_autodiff_and_torch():
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 2.0, (2, 3, 5, 7)).astype(np.float32)
    w = rng.normal(0.0, 1.0, x.shape).astype(np.float32)
    grad = ms.grad(WeightedSoftmax(Softmax()), 0)(Tensor(x), Tensor(w)).asnumpy()
    plain = ms.grad(WeightedSoftmax(PlainSoftmax()), 0)(Tensor(x), Tensor(w)).asnumpy()
    t = torch.tensor(x, requires_grad=True)
    (torch.softmax(t, -1) * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(grad, t.grad.numpy(), atol=1e-6)
    np.testing.assert_allclose(grad, plain, atol=1e-6)
