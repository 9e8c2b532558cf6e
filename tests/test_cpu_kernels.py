"""The compiled CPU kernels: attention (kernels/attention.cc, model.attention_kernel) and RMSNorm, SwiGLU, RoPE,
the Linears' products and the cross-entropy (kernels/layers.cc, model.layer_kernels), AdamW (kernels/optimizer.cc).
The same outputs and gradients as PyTorch's and as the model's plain path, built by the venv script; which twins a
config gets (models/llama/kernels.py, swapped in by models/llama/__init__.py apply_kernels), and a plain fallback
(auto) or one clear error (fused) where they are not built, on a non-x86 host or under MINDLAB_KERNELS=plain.

The tests that run the kernels skip where they are not built (or switched off: pytest --plain-ops); the selection
tests run everywhere, with every library reported built (`built`)."""
import functools
import os
import re
import shutil

import numpy as np
import pytest

import mindspore as ms
import torch
from mindspore import Parameter, Tensor, nn, ops
from omegaconf import OmegaConf

import kernels
from adapters.twins import libraries_in, overlay
from base.errors import ConfigError, UserError
from base.schema import is_sharded
from conftest import compose_cfg, load_preset
from models import attention_kind, build_model
from models.llama import kernel_libraries
from objectives._cross_entropy import KernelCrossEntropy, WeightedCrossEntropy
from planner.dry_run import dry_run_report

MISSING = next((why for path, why in map(kernels.library, kernels.SOURCES) if path is None), None)
needs_kernels = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))  # the reason says the fix


@pytest.fixture
def built(monkeypatch):
    """Every kernels/ library reported built and the switch unset: what the selection sees on an x86 box after
    scripts/venv.sh (the libraries are never loaded by the tests that use this)."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    monkeypatch.setattr(kernels, "library", lambda name: (f"/built/{name}.so", ""))


class SumWeighted(nn.Cell):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def construct(self, q, k, v, segments, weights):
        return (self.core(q, k, v, segments) * weights).sum()


class Gradients(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net, self.grad = net, ops.GradOperation(get_all=True)

    def construct(self, *inputs):
        return self.net(*inputs), self.grad(self.net)(*inputs)


@needs_kernels
@pytest.mark.parametrize("mode, s, starts", [("graph", 150, (40, 100)), ("pynative", 150, (40, 100)),
                                              ("graph", 1100, (300, 1000))],
                         ids=["graph", "pynative", "graph-1100-rows"])
def test_kernel_matches_pytorch_attention_with_gqa_and_packed_samples(mode, s, starts):
    """GQA (4 query heads on 2 kv heads), 150 rows (two full 64-row blocks and a ragged one), a row of three packed
    samples: output and the gradients of q, k, v against torch's masked softmax attention. At 1100 rows a block's
    keys come in up to three 512-key chunks (online softmax), and in the packed row some chunks hold no key of a
    block row's own sample."""
    from kernels.attention import FusedAttention

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        rng = np.random.default_rng(0)
        b, h, hkv, d = 2, 4, 2, 32
        q, k, v = (rng.standard_normal(shape, dtype=np.float32) for shape in ((b, s, h, d), (b, s, hkv, d), (b, s, hkv, d)))
        segments = np.zeros((b, s), np.int32)
        segments[1, starts[0]:], segments[1, starts[1]:] = 1, 2
        weights = rng.standard_normal((b, s, h, d), dtype=np.float32)
        loss, grads = Gradients(SumWeighted(FusedAttention()))(*map(Tensor, (q, k, v, segments, weights)))
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)

    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    seg = torch.tensor(segments)
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (seg[:, :, None] == seg[:, None, :])  # [b, s, s]
    out = torch.nn.functional.scaled_dot_product_attention(
        tq.transpose(1, 2), tk.repeat_interleave(h // hkv, 2).transpose(1, 2),
        tv.repeat_interleave(h // hkv, 2).transpose(1, 2), attn_mask=allowed[:, None]).transpose(1, 2)
    ref = (out * torch.tensor(weights, dtype=torch.float64)).sum()
    ref.backward()
    assert float(loss.asnumpy()) == pytest.approx(float(ref), rel=1e-5)
    for got, want in zip(grads[:3], (tq, tk, tv)):
        np.testing.assert_allclose(got.asnumpy(), want.grad.numpy(), atol=2e-5)


@functools.cache  # the kernel tests below share the plain and fused paths' graphs (~4 s of compile each)
def _model_loss_and_grads(packed: bool, recompute: str = "none", attention: str = "fused", layers: str = "fused"):
    cfg = load_preset("model", "tiny")
    cfg.attention_kernel, cfg.layer_kernels, cfg.recompute = attention, layers, recompute
    model = build_model(cfg, 96, "fp32", "CPU", seed=0)
    params = ms.ParameterTuple(model.trainable_params())
    rng = np.random.default_rng(1)
    tokens = Tensor(rng.integers(0, cfg.vocab_size, (2, 96)).astype(np.int32))
    weights = Tensor(rng.standard_normal((2, 96, cfg.vocab_size), dtype=np.float32))
    extra = ()
    if packed:  # samples of 50 and 46 tokens: positions restart, attention stays inside each
        extra = (Tensor(np.tile(np.r_[np.arange(50), np.arange(46)], (2, 1)).astype(np.int32)),
                 Tensor(np.tile(np.r_[np.zeros(50), np.ones(46)], (2, 1)).astype(np.int32)))

    targets = Tensor(rng.integers(0, cfg.vocab_size, 2 * 96).astype(np.int32))

    class Loss(nn.Cell):
        """Every logit weighted, plus the objectives' token cross-entropy (the kernel's with layers=fused)."""

        def __init__(self):
            super().__init__()
            self.model, self.cross_entropy = model, WeightedCrossEntropy()

        def construct(self, tokens, weights, *extra):
            logits = self.model(tokens, *extra)
            nll = self.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ops.ones(targets.shape, ms.float32))
            return (logits * weights).sum() + nll

    class Grads(nn.Cell):
        def __init__(self):
            super().__init__()
            self.loss, self.grad = Loss(), ops.GradOperation(get_by_list=True)
            overlay(self.loss, libraries_in(model))  # as trainer/module.py loss_cell: the cross-entropy follows

        def construct(self, *inputs):
            return self.loss(*inputs), self.grad(self.loss, params)(*inputs)

    loss, grads = Grads()(tokens, weights, *extra)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


@needs_kernels
@pytest.mark.parametrize("mode, b, hkv, length", [("graph", 2, 2, 40), ("pynative", 4, 4, 300)],
                         ids=["graph", "pynative-threaded"])
def test_the_decode_kernel_matches_pytorch_with_gqa_rope_and_a_padded_cache(mode, b, hkv, length):
    """One decoding step (kernels/attention.cc DecodeAttention): RoPE on the new q and k, k and v written in place
    at the slot's column of the caches (Parameters, as generation holds them), the query over the columns up to
    the slot under the bias (here hiding each row's left padding; the later columns are never read). GQA with 2
    query heads per kv head; the second case reads enough columns for the kernel's threads. Against torch in
    float64."""
    from kernels.attention import DecodeAttention

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        rng = np.random.default_rng(3)
        h, d, column = 2 * hkv, 64, length - 9
        normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
        q, k, v, cos, sin = normal(b, 1, h, d), normal(b, 1, hkv, d), normal(b, 1, hkv, d), normal(b, 1, 1, d), \
            normal(b, 1, 1, d)
        k_cache, v_cache = normal(b, hkv, length, d), normal(b, hkv, length, d)
        slot = (np.arange(length) == column)[None, None, :, None]
        visible = np.arange(length)[None] >= np.arange(b)[:, None] * 3
        bias = np.where(visible, 0.0, -1e9).astype(np.float32)[:, None, None, :]

        class Step(nn.Cell):
            def __init__(self):
                super().__init__()
                self.decode = DecodeAttention()
                self.k_cache, self.v_cache = (Parameter(Tensor(c), name) for c, name in ((k_cache, "k_cache"),
                                                                                         (v_cache, "v_cache")))

            def construct(self, *inputs):
                return self.decode(*inputs[:5], self.k_cache, self.v_cache, *inputs[5:])

        step = Step()
        out = step(*map(Tensor, (q, k, v, cos, sin, slot, bias))).asnumpy()
        new_k, new_v = step.k_cache.asnumpy(), step.v_cache.asnumpy()
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    cos_t, sin_t = t(cos).transpose(1, 2), t(sin).transpose(1, 2)  # [B, 1, 1, D] -> per row, any head
    want_k, want_v = t(k_cache), t(v_cache)
    want_k[:, :, column] = _torch_rope(t(k).transpose(1, 2), cos_t, sin_t)[:, :, 0]
    want_v[:, :, column] = t(v)[:, 0]
    rq = _torch_rope(t(q).transpose(1, 2), cos_t, sin_t)  # [B, H, 1, D]
    keys, values = want_k.repeat_interleave(2, 1), want_v.repeat_interleave(2, 1)
    seen = slice(0, column + 1)
    probs = torch.softmax(rq @ keys[:, :, seen].transpose(-1, -2) / np.sqrt(d) + t(bias)[..., seen], -1)
    want = (probs @ values[:, :, seen]).transpose(1, 2)  # [B, 1, H, D]
    np.testing.assert_array_equal(new_v, want_v.numpy().astype(np.float32))
    np.testing.assert_allclose(new_k, want_k.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.slow  # model=tiny's gradient graph compiled per path (~4 s each); the op tests below stay fast
@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed"])
def test_the_model_gives_the_same_loss_and_gradients_with_either_kernel(packed):
    """model=tiny (GQA) in graph mode: every parameter's gradient equal to the plain path's (the path tested
    against transformers and MindFormers in test_model.py / test_convert.py)."""
    plain_loss, plain_grads = _model_loss_and_grads(packed, attention="plain", layers="plain")
    fused_loss, fused_grads = _model_loss_and_grads(packed, attention="fused", layers="plain")
    assert fused_loss == pytest.approx(plain_loss, rel=1e-5)
    for got, want in zip(fused_grads, plain_grads):  # to 1e-5 of each gradient's largest entry (fp32 sums)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_kernels
@pytest.mark.slow  # model=tiny's gradient graph compiled per path (~4 s each); the op tests below stay fast
@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed"])
def test_the_model_gives_the_same_loss_and_gradients_with_or_without_the_layer_kernels(packed):
    """model=tiny with RMSNorm, SwiGLU, RoPE and the cross-entropy by kernels/layers.cc against MindSpore's ops
    (both with the fused attention; with plain attention the RoPE kernel sees the [B, heads, S, D] layout)."""
    from objectives.clm import Objective
    from trainer.module import loss_cell

    cfg = load_preset("model", "tiny")
    cfg.layer_kernels = "fused"
    net = loss_cell(Objective(compose_cfg("model=tiny").objective), build_model(cfg, 96, "fp32", "CPU", seed=0))
    assert isinstance(net.cross_entropy, KernelCrossEntropy)
    for attention in ("fused", "plain"):
        plain_loss, plain_grads = _model_loss_and_grads(packed, attention=attention, layers="plain")
        fused_loss, fused_grads = _model_loss_and_grads(packed, attention=attention, layers="fused")
        assert fused_loss == pytest.approx(plain_loss, rel=1e-5)
        for got, want in zip(fused_grads, plain_grads):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


class SumOf(nn.Cell):
    """sum(op(*inputs) * weights): every output element gets its own gradient."""

    def __init__(self, op, constants=()):
        super().__init__()
        self.op, self.constants = op, constants

    def construct(self, weights, *inputs):
        return (self.op(*inputs, *self.constants) * weights).sum()


def _torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@needs_kernels
@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope [B,S,H,D] x [S,1,D]", "rope [B,S,H,D] x [B,S,1,D]",
                                "rope [B,H,S,D] x [S,D]", "cross_entropy", "row_linear", "linear", "rms_norm, threaded",
                                "swiglu, threaded", "cross_entropy, threaded", "linear, threaded"])
def test_each_layer_kernel_matches_pytorch(op):
    """Output and input gradients against torch autograd in float64 (graph mode); RoPE's tables in each layout
    the model passes, with sin/cos halves that differ (as no real table does), so a transposed rotation would show;
    the cross-entropy with large logits (a naive exp overflows) and an ignored target (-100: nll 0, no gradient);
    the one-row product with an inner size that is no multiple of a vector's 16 floats (the loop's tail); the
    Linear's product on 3-D x. "threaded": inputs past threads.h's kThreadedWork (2^16 floats), split over a thread
    per core, the RMSNorm's weight gradient summed over the threads' ranges, the Linear's 301 rows (its output and
    x's gradient) and 300 weight rows (its gradient) split unevenly; the small ones run on the calling thread."""
    from kernels.layers import (CrossEntropyKernel, LinearKernel, RMSNormKernel, RoPEKernel, RowLinearKernel,
                                SwiGLUKernel)

    rng = np.random.default_rng(2)
    threaded = op.endswith(", threaded")
    op = op.replace(", threaded", "")
    x = rng.standard_normal((4, 64, 3, 128) if threaded else (2, 6, 3, 8), dtype=np.float32) * 2
    if op == "cross_entropy":
        rows = 80 if threaded else 36
        x = rng.standard_normal((rows, 1000), dtype=np.float32) * 30 + 100
        targets = rng.integers(0, 1000, rows).astype(np.int32)
        targets[5] = -100
        inputs, constants, cell = (x,), (Tensor(targets),), CrossEntropyKernel()
        ref = lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(targets, dtype=torch.long), reduction="none")
    elif op == "row_linear":
        x = rng.standard_normal((1, 37), dtype=np.float32)
        inputs, constants, cell = (x, rng.standard_normal((53, 37), dtype=np.float32)), (), RowLinearKernel()
        ref = lambda x, w: x @ w.T
    elif op == "linear":
        *lead, k, n = (7, 43, 230, 300) if threaded else (2, 5, 37, 53)
        x = rng.standard_normal((*lead, k), dtype=np.float32)
        inputs, constants, cell = (x, rng.standard_normal((n, k), dtype=np.float32) * 0.1), (), LinearKernel()
        ref = lambda x, w: x @ w.T
    elif op == "rms_norm":
        inputs, constants, cell = (x, rng.standard_normal(x.shape[-1], dtype=np.float32)), (), RMSNormKernel(1e-5)
        ref = lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    elif op == "swiglu":
        inputs, constants, cell = (x, rng.standard_normal(x.shape, dtype=np.float32)), (), SwiGLUKernel()
        ref = lambda g, u: torch.nn.functional.silu(g) * u
    else:
        table = {"[S,1,D]": (6, 1, 8), "[B,S,1,D]": (2, 6, 1, 8), "[S,D]": (3, 8)}[op.split(" x ")[1]]
        tables = [rng.standard_normal(table, dtype=np.float32) for _ in range(2)]
        inputs, constants, cell = (x,), tuple(map(Tensor, tables)), RoPEKernel()
        ref = lambda x: _torch_rope(x, *(torch.tensor(t, dtype=torch.float64) for t in tables))
    out_shape = {"cross_entropy": x.shape[:1], "row_linear": (1, 53)}.get(op, x.shape)
    if op == "linear":
        out_shape = x.shape[:-1] + inputs[1].shape[:1]
    weights = rng.standard_normal(out_shape, dtype=np.float32)
    loss, grads = Gradients(SumOf(cell, constants))(Tensor(weights), *map(Tensor, inputs))
    torch_inputs = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in inputs]
    want = (ref(*torch_inputs) * torch.tensor(weights, dtype=torch.float64)).sum()
    want.backward()
    assert float(loss.asnumpy()) == pytest.approx(float(want), rel=1e-5)
    for got, t in zip(grads[1:], torch_inputs):
        np.testing.assert_allclose(got.asnumpy(), t.grad.numpy(), rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.slow
def test_full_recompute_through_the_kernel_gives_the_same_gradients():
    """model.recompute=full reruns the layer, the kernel's forward included, in the backward."""
    ref_loss, ref_grads = _model_loss_and_grads(False, attention="fused", layers="fused")
    loss, grads = _model_loss_and_grads(False, "full")
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for got, want in zip(grads, ref_grads):
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_auto_picks_the_kernels_where_they_apply(built):
    m = load_preset("model", "tiny")
    assert kernel_libraries(m, "fp32", "CPU", False) == {"attention", "layers"}
    assert kernel_libraries(m, "fp16", "CPU", False) == set()  # the kernels are fp32
    assert kernel_libraries(m, "fp32", "Ascend", False) == set()
    assert kernel_libraries(m, "fp32", "CPU", True) == set()  # a tp/pp layout: plan.py's strategies, on the plain ops
    assert attention_kind(m, "Ascend", "bf16", False) == "flash"  # (fp32 with flash: refused, tests/test_cluster_path.py)
    m.attention_chunk = 64  # an explicit plain-attention setting; the layer kernels still apply
    assert kernel_libraries(m, "fp32", "CPU", False) == {"layers"}
    m.attention_chunk, m.layer_kernels = 0, "plain"
    assert kernel_libraries(m, "fp32", "CPU", False) == {"attention"}
    m.impl = "mindformers"
    assert kernel_libraries(m, "fp32", "CPU", False) == set()


def test_without_the_built_kernels_auto_is_plain_and_fused_is_one_error(monkeypatch, tmp_path):
    from trainer import fused_adamw

    monkeypatch.delenv(kernels.SWITCH, raising=False)
    monkeypatch.setattr("sys.prefix", str(tmp_path))  # a venv the kernels were never built into
    path, why = kernels.library("attention")
    assert path is None and "scripts/venv.sh" in why
    m = load_preset("model", "tiny")
    assert kernel_libraries(m, "fp32", "CPU", False) == set()
    for key, library in (("attention_kernel", "attention"), ("layer_kernels", "layers")):
        with pytest.raises(ConfigError, match=rf"model\.{key}: fused: kernels/{library}\.cc is not built"):
            kernel_libraries(OmegaConf.merge(m, {key: "fused"}), "fp32", "CPU", False)
    assert not fused_adamw.applies([Parameter(Tensor(np.zeros(3, np.float32)), name="w")], "CPU", False)


def test_the_switch_runs_everything_on_plain_ops_and_fused_is_refused_in_one_line(monkeypatch):
    """MINDLAB_KERNELS=plain (pytest --plain-ops): no library, so auto is plain and fused one ConfigError at
    validation naming the switch; an unknown value is one error naming it."""
    from base.validate import validate

    monkeypatch.setenv(kernels.SWITCH, "plain")
    assert all(kernels.library(name) == (None, "MINDLAB_KERNELS=plain turns the compiled kernels off (unset it to "
                                                "use them)") for name in kernels.SOURCES)
    assert kernel_libraries(load_preset("model", "tiny"), "fp32", "CPU", False) == set()
    with pytest.raises(ConfigError, match=r"^model\.layer_kernels: fused: MINDLAB_KERNELS=plain turns"):
        validate(compose_cfg("model.layer_kernels=fused"))
    monkeypatch.setenv(kernels.SWITCH, "fast")
    with pytest.raises(UserError, match="MINDLAB_KERNELS=fast: set it to plain"):
        kernels.library("layers")


def test_the_build_key_is_the_source_flags_and_cpu_not_the_checkout(tmp_path):
    """Every clone sharing the venv finds the same libraries: the key of a copy of kernels/ elsewhere is the same;
    an edited source (or header) gets another."""
    lib = "/venv/lib/mindspore/lib"  # only named in the command
    copy = tmp_path / "other-clone" / "kernels"
    shutil.copytree(kernels.HERE, copy)
    for name in kernels.SOURCES:
        assert kernels.library_path(name, lib, str(copy)) == kernels.library_path(name, lib)
    with open(copy / "threads.h", "a", encoding="utf-8") as f:
        f.write("\n// edited\n")
    assert kernels.library_path("layers", lib, str(copy)) != kernels.library_path("layers", lib)


def test_a_non_x86_host_builds_nothing_and_says_why_in_one_line(monkeypatch, tmp_path, capsys):
    """An ARM server (Ascend's hosts): no compiler run, one line, and the models on their plain ops."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("the compiler ran on a non-x86 host"))
    kernels.build()
    err = capsys.readouterr().err.splitlines()
    assert err == ["[mindlab] kernels/ is x86 code (AVX intrinsics) and this host is aarch64: nothing is built, "
                   "the models use their plain MindSpore ops"]
    assert not os.path.exists(tmp_path / "mindlab-kernels")
    assert kernels.library("layers")[0] is None
    assert kernel_libraries(load_preset("model", "tiny"), "fp32", "CPU", False) == set()


def _cell_modules(model) -> set:
    return {type(cell).__module__ for _, cell in model.cells_and_names() if not isinstance(cell, nn.CellList)}


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_a_model_built_for_a_tensor_or_pipeline_layout_holds_only_plain_cells(built, layout):
    """As trainer/loop.py builds it (build_model's `sharded` from the composed layout, not MindSpore's context):
    the plan's strategies are set on the plain ops; the dry run plans the plain attention for it."""
    cfg = compose_cfg("model=tiny", layout)
    model = build_model(cfg.model, 64, cfg.precision.compute_dtype, cfg.device.target, 0, is_sharded(cfg.parallel))
    assert _cell_modules(model) == {"models.llama.model", "models.common.attention", "models.common.layers"}
    assert "attention plain" in dry_run_report(cfg)


def test_an_fp32_cpu_single_device_model_holds_the_twins_and_the_dry_run_agrees(built):
    from models.llama import kernels as twins_of_llama

    cfg = compose_cfg("model=tiny")
    model = build_model(cfg.model, 64, "fp32", "CPU", 0, is_sharded(cfg.parallel))
    layer = model.model.layers[0]
    assert isinstance(model.model, twins_of_llama.KernelLayoutLlamaModel)
    assert isinstance(layer.attention, twins_of_llama.KernelAttention)
    assert isinstance(layer.attention.rope, twins_of_llama.KernelRotary)
    assert isinstance(layer.attention_norm, twins_of_llama.KernelRMSNorm)
    assert isinstance(layer.feed_forward, twins_of_llama.KernelFeedForward)
    assert isinstance(layer.feed_forward.w1, twins_of_llama.KernelLinear)
    assert isinstance(model.lm_head, twins_of_llama.KernelLinear)
    assert libraries_in(model) == {"attention", "layers"}
    assert "attention fused" in dry_run_report(cfg)
    names = sorted(p.name for p in model.get_parameters())  # the twins adopt the plain cells' Parameters
    plain = build_model(OmegaConf.merge(cfg.model, {"attention_kernel": "plain", "layer_kernels": "plain"}), 64,
                        "fp32", "CPU", 0)
    assert names == sorted(p.name for p in plain.get_parameters())
    for ours, theirs in zip(sorted(model.get_parameters(), key=lambda p: p.name),
                            sorted(plain.get_parameters(), key=lambda p: p.name)):
        np.testing.assert_array_equal(ours.asnumpy(), theirs.asnumpy())


@needs_kernels
@pytest.mark.slow  # g++ builds the kernels afresh, ~5 s
def test_the_venv_build_compiles_the_kernel(monkeypatch, tmp_path, capsys):
    """What scripts/venv.sh runs (`python -m kernels`), into an empty venv: the library appears where the models
    look for it, once."""
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    kernels.build()
    err = capsys.readouterr().err
    for name in kernels.SOURCES:
        path, _ = kernels.library(name)
        assert path is not None and path.startswith(str(tmp_path)) and os.path.getsize(path) > 0
        assert f"built kernels/{name}.cc" in err
    kernels.build()
    assert capsys.readouterr().err == ""  # nothing to do the second time


def test_the_dry_run_plans_no_probabilities_under_the_kernel(built):
    """The planner's activation term a*s/h (the softmax output) is dropped, as for flash attention."""
    fused = compose_cfg("model=tiny", "data.seq_len=512")
    plain = compose_cfg("model=tiny", "data.seq_len=512", "model.attention_kernel=plain")
    assert attention_kind(fused.model, "CPU", "fp32", False) == "fused"
    assert attention_kind(fused.model, "CPU", "fp32", True) == "plain"  # a tp/pp layout: plan.py's ops
    reports = {"fused": dry_run_report(fused), "plain": dry_run_report(plain)}
    assert "attention fused" in reports["fused"] and "attention plain" in reports["plain"]
    by_mode = {kind: dict(re.findall(r"(none|selective|full) ([\d.]+)", text.split("recompute=none (")[1].split(")")[0]))
               for kind, text in reports.items()}
    assert by_mode["plain"]["none"] > by_mode["plain"]["selective"]  # plain keeps the probabilities
    assert by_mode["fused"]["none"] == by_mode["fused"]["selective"] == by_mode["plain"]["selective"]


@needs_kernels
@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_the_adamw_kernel_steps_as_the_graph_of_mindspore_ops(mode):
    """trainer/step.py ClipAndUpdate with AdamW by kernels/optimizer.cc (its norm and update ops) against
    the same cell on MindSpore's ops (square sums, clipping product, AdamWeightDecay: equal to MindFormers' AdamW
    and torch's, tests/test_step.py): norms, weights, both moments and the update count over six steps of warmup,
    with a decayed and an exempt group, clipping active and a loss scale of 4. A step the host refuses (allow
    False) and one with a NaN gradient leave everything as it was and do not advance the count."""
    from base.schema import OPTIMIZERS
    from omegaconf import OmegaConf
    from mindspore import Parameter
    from trainer.fused_adamw import FusedAdamW, applies
    from trainer.adamw import AdamW
    from trainer.optimizer import build_schedule, param_groups
    from trainer.step import ClipAndUpdate

    cfg = OmegaConf.merge(OmegaConf.structured(OPTIMIZERS["adamw"]),
                          {"name": "adamw", "warmup_steps": 2, "weight_decay": 0.1})
    shapes = {"w.weight": (64, 32), "norm.weight": (32,), "embedding.weight": (1000,)}
    steps = [(True, 1.0), (True, 1.0), (False, 1.0), (True, np.nan), (True, 1.0), (True, 1.0)]  # (allow, grad x)
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        states, norms = {}, {}
        for kernel in (False, True):
            init = np.random.default_rng(1)
            params = [Parameter(Tensor(init.standard_normal(s).astype(np.float32)), name=n) for n, s in shapes.items()]
            assert applies(params, "CPU", False) and not applies(params, "CPU", True)
            optimizer = (FusedAdamW if kernel else AdamW)(param_groups(params, cfg), build_schedule(cfg, 10),
                                                          tuple(cfg.betas), cfg.eps)
            update, rng, norms[kernel] = ClipAndUpdate(optimizer, clip_grad_norm=20.0), np.random.default_rng(2), []
            for allow, times in steps:
                before = [p.asnumpy().copy() for p in optimizer.parameters]
                # ~4 x norm 55: clipped to 20. mutable: a plain tuple of new tensors gets a new argument key on
                # every call, and the update would be compiled again each time
                grads = ms.mutable(tuple(Tensor(4 * times * rng.standard_normal(p.shape).astype(np.float32))
                                         for p in optimizer.parameters))
                norm, finite, _ = update(grads, Tensor(allow), Tensor(0.25, ms.float32))
                norms[kernel].append(float(norm.asnumpy()))
                assert bool(finite.asnumpy()) == np.isfinite(times)
                if not (allow and np.isfinite(times)):
                    assert all(np.array_equal(p.asnumpy(), b) for p, b in zip(optimizer.parameters, before))
            assert int(optimizer.global_step.asnumpy()) == 4
            states[kernel] = [x.asnumpy() for x in (*optimizer.parameters, *optimizer.exp_avg, *optimizer.exp_avg_sq)]
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    np.testing.assert_allclose(norms[True], norms[False], rtol=1e-6)
    assert 50 < norms[True][0] < 60  # the unscaled norm: clipping was active
    for got, want in zip(states[True], states[False]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not applies([Parameter(Tensor(np.zeros(3, np.float16)), name="half")], "CPU", False)
    plain = AdamW(param_groups(params, cfg), build_schedule(cfg, 10), tuple(cfg.betas), cfg.eps)
    assert sorted(optimizer.parameters_dict()) == sorted(plain.parameters_dict())  # checkpoints load into either
