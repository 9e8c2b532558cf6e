"""objectives/_cross_entropy.py: the hand-written cross-entropy gradient equals autodiff's, in both modes."""
import numpy as np
import pytest

import mindspore as ms
import torch
from mindspore import Tensor, nn, ops

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
