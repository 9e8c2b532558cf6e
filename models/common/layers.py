"""The cells decoder families share, moved out of the Llama model unchanged: the Linear (no bias, computed in the
compute dtype), RMSNorm, the SwiGLU feed-forward and the token embedding. Parameter names are MindFormers' Llama
names (models/llama/model.py's docstring maps them to Hugging Face's); plain MindSpore, so the device and kernel
twins (models/llama/kernels.py, device_ops.py) and the tensor-parallel plans find them by type. ReusedLayer is the
base of the families' decoder layers, whose graph compiles once for all layers.
"""
from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}


def _init(rng: Optional[np.random.Generator], shape, std: float) -> Parameter:
    """N(0, std) weights: drawn now from `rng` (identical on every rank and backend), or with rng None (a sharded
    build) deferred to MindSpore's initializer, which the semi-auto compile runs on each rank's slice only, as
    MindFormers does: no rank materialises the whole model (a 70B model is 280 GB of fp32)."""
    if rng is None:
        return Parameter(initializer(Normal(std), shape, ms.float32))
    return Parameter(Tensor(rng.normal(0.0, std, size=shape).astype(np.float32)))


class Linear(nn.Cell):
    """y = x @ W^T with W [out, in] (no bias), computed in `compute_dtype`."""

    def __init__(self, in_features: int, out_features: int, std: float, rng, compute_dtype):
        super().__init__()
        self.weight = _init(rng, (out_features, in_features), std)
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).astype(self.compute_dtype)
        return self.matmul(x, self.weight.astype(self.compute_dtype)).reshape(shape[:-1] + (-1,))


class RMSNorm(nn.Cell):
    """x / rms(x) * weight in fp32, over x's last axis. Written with primitives so sequence parallelism can shard
    each of them (plan.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)))
        self.eps = eps
        self.square, self.mean, self.add, self.rsqrt = ops.Square(), ops.ReduceMean(keep_dims=True), ops.Add(), ops.Rsqrt()
        self.normalize, self.scale = ops.Mul(), ops.Mul()

    def construct(self, x):
        x32 = x.astype(ms.float32)
        inv_rms = self.rsqrt(self.add(self.mean(self.square(x32), -1), self.eps))
        return self.scale(self.normalize(x32, inv_rms), self.weight).astype(x.dtype)


class FeedForward(nn.Cell):
    """SwiGLU: w2(silu(w1 x) * w3 x), `width` wide (default cfg.intermediate_size; a shared expert's own)."""

    def __init__(self, cfg, rng, compute_dtype, width: int = 0):
        super().__init__()
        h, f, std = cfg.hidden_size, width or cfg.intermediate_size, cfg.init_std
        self.w1 = Linear(h, f, std, rng, compute_dtype)
        self.w2 = Linear(f, h, std, rng, compute_dtype)
        self.w3 = Linear(h, f, std, rng, compute_dtype)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class ReusedLayer(nn.Cell):
    """A decoder layer compiled once and reused for every layer: its family decorates its __init__ with
    `@ms.lazy_inline(policy="front")`, which parses one layer's graph and inlines it N times ("front" policy; the
    default keeps it a called subgraph, which does not compile on CPU). MindSpore marks the API Ascend-only; it is
    tested here on CPU against PyNative (tests/test_lora.py) and against transformers (tests/test_moe.py).

    `cell_init_args` is the key under which lazy_inline reuses a layer's graph. MindSpore's is the constructor's
    arguments, the same for every layer even after a converter changed some of them (LoRA on
    `re:model\\.layers\\.0\\..*`): they would share one graph. This key is the layer's structure: its cells' types and
    its parameters' shapes, dtypes and trainability. Each layer's graph reads and writes its own Parameters
    (the inlined copies are given the layer's), so state a layer keeps (a MoE router's bias and load counts) stays
    its own."""

    @property
    def cell_init_args(self) -> str:
        cells = [f"{name}:{type(cell).__name__}" for name, cell in self.cells_and_names()]
        params = [f"{name}:{p.shape}:{p.dtype}:{p.requires_grad}" for name, p in self.parameters_and_names()]
        return f"lazy_inline_{type(self).__name__}{cells}{params}"

    @cell_init_args.setter
    def cell_init_args(self, value: str) -> None:
        """lazy_inline and Cell assign the argument-based key; the property above replaces it."""


class Embedding(nn.Cell):
    def __init__(self, vocab_size: int, dim: int, std: float, rng):
        super().__init__()
        self.embedding_weight = _init(rng, (vocab_size, dim), std)
        self.gather = ops.Gather()

    def construct(self, ids):
        return self.gather(self.embedding_weight, ids, 0)
