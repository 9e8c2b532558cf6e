"""The device twins (models/llama/device_ops.py): which cells each device's build holds, and that the CPU
workarounds compute what model.py's plain ops compute. Ascend's fused RmsNorm and RotaryPositionEmbedding have no CPU
kernel: their builds are inspected here, never run."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn
from omegaconf import OmegaConf

from conftest import load_preset
from models import build_model
from models.llama import build as build_plain
from models.llama import device_ops
from models.llama.model import AttentionBlock, FlashCoreAttention, RMSNorm, Rotary, apply_rope


def plain_cfg(**overrides):
    """model=tiny with GQA and the compiled kernels off: what the device twins see."""
    return OmegaConf.merge(load_preset("model", "tiny"), {"num_kv_heads": 2, "attention_kernel": "plain",
                                                          "layer_kernels": "plain", **overrides})


def kinds(model, *classes):
    """{class name} of the model's cells that are instances of `classes`."""
    return {type(cell).__name__ for _, cell in model.cells_and_names() if isinstance(cell, classes)}


def test_each_device_gets_its_own_cells():
    cells = (RMSNorm, Rotary, AttentionBlock, FlashCoreAttention)
    assert kinds(build_model(plain_cfg(), 32, "fp32", "CPU", 0), *cells) == \
        {"CpuRMSNorm", "CpuRotary", "CpuAttentionBlock"}
    assert kinds(build_model(plain_cfg(), 32, "bf16", "Ascend", 0), *cells) == \
        {"FusedRMSNorm", "FusedRotary", "FlashCoreAttention"}
    assert kinds(build_model(plain_cfg(), 32, "bf16", "Ascend", 0, sharded=True), *cells) == \
        {"FusedRMSNorm", "Rotary", "FlashCoreAttention"}  # RoPE under tp/pp: the plain products the plan sees
    assert kinds(build_model(plain_cfg(), 32, "bf16", "GPU", 0), *cells) == {"RMSNorm", "Rotary", "AttentionBlock"}
    assert kinds(build_model(plain_cfg(), 32, "fp32", "CPU", 0, sharded=True), *cells) == \
        {"RMSNorm", "Rotary", "AttentionBlock"}


class WeightedLogits(nn.Cell):
    """sum(logits * w): a loss whose gradient reaches every logit (and through it every cell) differently."""

    def __init__(self, model, weights):
        super().__init__(auto_prefix=False)
        self.model, self.weights = model, weights

    def construct(self, x, positions=None, segments=None):
        return (self.model(x, positions, segments) * self.weights).sum()


def _loss_and_grads(model, packed: bool):
    rng = np.random.default_rng(0)
    x = Tensor(rng.integers(0, 4096, (2, 32)).astype(np.int32))
    net = WeightedLogits(model, Tensor(rng.standard_normal((2, 32, 4096)).astype(np.float32)))
    inputs = (x,)
    if packed:  # two samples per row: positions restart, the segment mask is the attention bias
        inputs += (Tensor(np.tile(np.r_[np.arange(20), np.arange(12)], (2, 1)).astype(np.int32)),
                   Tensor(np.tile(np.r_[np.zeros(20), np.ones(12)], (2, 1)).astype(np.int32)))
    loss, grads = ms.value_and_grad(net, None, ms.ParameterTuple(model.trainable_params()))(*inputs)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["causal", "packed"])
def test_the_cpu_workarounds_give_the_plain_ops_loss_and_gradients(packed):
    """The plain model (MindSpore's broadcasting, 3-D reductions, autodiff's softmax gradient) against the same
    weights with the CPU twins, forward and backward, GQA and packed samples included."""
    cfg = plain_cfg()
    twin = build_model(cfg, 32, "fp32", "CPU", 0)
    assert {"CpuRMSNorm", "CpuAttentionBlock"} <= kinds(twin, RMSNorm, AttentionBlock)
    loss, grads = _loss_and_grads(twin, packed)
    ref_loss, ref_grads = _loss_and_grads(build_plain(cfg, 32, "fp32", False, 0), packed)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_fused_rope_leaves_decoding_steps_to_the_plain_products():
    """MindSpore documents RotaryPositionEmbedding as slow where batch x heads > 8 x sequence (a decoding step)."""
    rope = device_ops.FusedRotary(Rotary())
    calls = []
    rope.rotary = lambda *args: calls.append(args) or args[0]
    x = Tensor(np.ones((4, 8, 1, 16), np.float32))
    table = Tensor(np.ones((1, 16), np.float32))
    np.testing.assert_array_equal(rope.construct(x, table, table).asnumpy(), apply_rope(x, table, table).asnumpy())
    assert calls == []
    rope.construct(Tensor(np.ones((1, 8, 64, 16), np.float32)), *[Tensor(np.ones((64, 16), np.float32))] * 2)
    assert [tuple(a.shape) for a in calls[0][:3]] == [(1, 8, 64, 16), (1, 1, 64, 16), (1, 1, 64, 16)]
