"""The native Llama against MindFormers' Llama, the parameter accounting, and the model's invariants."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor
from omegaconf import OmegaConf

from conftest import load_preset
from models import build_model
from models.llama.accounting import parameter_count
from objectives.clm import CausalLMLoss
from trainer.step import ForwardBackward

pytestmark = pytest.mark.usefixtures("pynative")  # recompute needs graph mode: see below


def tiny(**overrides):
    return OmegaConf.merge(load_preset("model", "tiny"), overrides)


def tokens(shape, vocab=4096, seed=0):
    return Tensor(np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32))


def test_native_matches_mindformers_llama_with_the_same_weights():
    """Same names, same shapes, same RoPE convention: copying weights 1:1 gives the same logits."""
    cfg = tiny()
    native = build_model(cfg, 64, "fp32", "CPU", seed=0)
    mf = build_model(tiny(impl="mindformers"), 64, "fp32", "CPU", seed=1)
    mf_params = {p.name: p for p in mf.get_parameters()}
    assert sorted(mf_params) == sorted(p.name for p in native.get_parameters())
    for p in native.get_parameters():
        mf_params[p.name].set_data(p.data.copy())
    x = tokens((2, 64))
    np.testing.assert_allclose(native(x).asnumpy(), mf(x).asnumpy(), atol=1e-5)


@pytest.mark.parametrize("name,tie", [("tiny", False), ("tiny", True), ("small", False)])
def test_parameter_count_formula_matches_built_model(name, tie):
    cfg = OmegaConf.merge(load_preset("model", name), {"tie_embeddings": tie})
    model = build_model(cfg, 16, "fp32", "CPU", seed=0)
    assert sum(p.size for p in model.trainable_params()) == parameter_count(cfg)["total"]


def test_attention_is_causal():
    model = build_model(tiny(), 32, "fp32", "CPU", seed=0)
    x = tokens((1, 32)).asnumpy()
    y = x.copy()
    y[0, 20] = (y[0, 20] + 1) % 4096
    a, b = model(Tensor(x)).asnumpy(), model(Tensor(y)).asnumpy()
    np.testing.assert_array_equal(a[:, :20], b[:, :20])
    assert np.abs(a[:, 20:] - b[:, 20:]).max() > 1e-4


def test_grouped_query_attention_equals_mha_with_shared_kv_heads():
    """KV head j serves query heads j*g .. j*g+g-1 (Hugging Face's repeat_kv order)."""
    gqa = build_model(tiny(num_kv_heads=2), 16, "fp32", "CPU", seed=0)
    mha = build_model(tiny(num_kv_heads=4), 16, "fp32", "CPU", seed=0)
    mha_params = {p.name: p for p in mha.get_parameters()}
    for p in gqa.get_parameters():
        value = p.asnumpy()
        if p.name.endswith(("attention.wk.weight", "attention.wv.weight")):
            value = np.repeat(value.reshape(2, 32, 128), 2, axis=0).reshape(128, 128)
        mha_params[p.name].set_data(Tensor(value))
    x = tokens((2, 16))
    np.testing.assert_allclose(gqa(x).asnumpy(), mha(x).asnumpy(), atol=1e-5)


def test_clm_loss_matches_numpy_reference_and_ignores_masked_labels():
    model = build_model(tiny(), 16, "fp32", "CPU", seed=0)
    loss_net = CausalLMLoss(model, ignore_index=-100)
    x = tokens((2, 17))
    labels = x.asnumpy().copy()
    labels[0, 5:9] = -100
    logits = model(x[:, :-1]).asnumpy().astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    target = labels[:, 1:]
    keep = target != -100
    ref = -np.take_along_axis(logp, np.where(keep, target, 0)[..., None], -1)[..., 0][keep].mean()
    np.testing.assert_allclose(float(loss_net(x, Tensor(labels))[0].asnumpy()), ref, rtol=1e-5)


def _loss_and_grads(cfg, compute_dtype="fp32"):
    model = build_model(cfg, 32, compute_dtype, "CPU", seed=0)
    loss_net = CausalLMLoss(model)
    forward_backward = ForwardBackward(loss_net, ms.ParameterTuple(model.trainable_params()))
    x = tokens((2, 33))
    (loss,) = forward_backward(Tensor(1.0, ms.float32), x, x)
    return float(loss.asnumpy()), [g.asnumpy() for g in forward_backward.grad_buffers]


@pytest.fixture(scope="module")
def reference():
    """model=tiny's fp32 loss and gradients on the default path (graph mode), which each variant below must give:
    compiled once for the module's five comparisons."""
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        return _loss_and_grads(tiny())
    finally:
        ms.set_context(mode=mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(mode, reference):
    ms.set_context(mode=ms.GRAPH_MODE)  # recompute is a pass of the graph compiler
    ref_loss, ref_grads = reference
    loss, grads = _loss_and_grads(tiny(recompute=mode))
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_fp16_compute_stays_close_to_fp32(reference):
    ref_loss, _ = reference
    loss, grads = _loss_and_grads(tiny(), "fp16")
    assert loss == pytest.approx(ref_loss, abs=2e-2)
    assert all(g.dtype == np.float32 for g in grads)  # master weights and their gradients stay fp32


def test_chunked_attention_gives_the_same_loss_and_gradients(reference):
    """model.attention_chunk: query blocks against their causal keys only; same numbers as one block."""
    ref_loss, ref_grads = reference
    loss, grads = _loss_and_grads(tiny(attention_chunk=12))  # 32 = 12 + 12 + 8: a ragged last block
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # packed samples: the segment mask is sliced per block
    x = tokens((2, 32))
    positions = Tensor(np.tile(np.r_[np.arange(20), np.arange(12)], (2, 1)).astype(np.int32))
    segments = Tensor(np.tile(np.r_[np.zeros(20), np.ones(12)], (2, 1)).astype(np.int32))
    plain = build_model(tiny(), 32, "fp32", "CPU", seed=0)(x, positions, segments).asnumpy()
    chunked = build_model(tiny(attention_chunk=12), 32, "fp32", "CPU", seed=0)(x, positions, segments).asnumpy()
    np.testing.assert_allclose(chunked, plain, atol=1e-5)


@pytest.mark.slow
def test_chunked_attention_with_selective_recompute_in_graph_mode(reference):
    ms.set_context(mode=ms.GRAPH_MODE)
    ref_loss, ref_grads = reference
    loss, grads = _loss_and_grads(tiny(attention_chunk=8, recompute="selective"))
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-6)
