"""The cells decoder families share, moved out of the Llama model unchanged: the Linear (no bias, computed in the
compute dtype), RMSNorm, the SwiGLU feed-forward and the token embedding. Parameter names are MindFormers' Llama
names (models/llama/model.py's docstring maps them to Hugging Face's); plain MindSpore, so the device and kernel
twins (models/llama/kernels.py, device_ops.py) and the tensor-parallel plans find them by type.
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


class Embedding(nn.Cell):
    def __init__(self, vocab_size: int, dim: int, std: float, rng):
        super().__init__()
        self.embedding_weight = _init(rng, (vocab_size, dim), std)
        self.gather = ops.Gather()

    def construct(self, ids):
        return self.gather(self.embedding_weight, ids, 0)
