"""Device twins of models/llama/model.py's cells: the same computation in the ops a device wants, swapped in after the
build by the family's apply_kernels (adapters/twins.py overlay), decided from the config (device_passes). model.py
itself uses MindSpore's ops as written, which is what Ascend/GPU run without these.

    "cpu"     (every native model on CPU outside a tp/pp layout, CPU kernels or not)
              RMSNorm -> CpuRMSNorm, Rotary -> CpuRotary, AttentionBlock -> CpuAttentionBlock
    "ascend"       (on Ascend) RMSNorm -> FusedRMSNorm (RmsNorm; the plan shards it under sequence parallelism)
    "ascend-rope"  (on Ascend outside a tp/pp layout) Rotary -> FusedRotary (RotaryPositionEmbedding)

The CPU twins are workarounds for MindSpore's CPU kernels, measured on them:
- Broadcasting: the elementwise ops whose operands differ in shape (RMSNorm's 1/rms and weight, RoPE's cos/sin, the
  attention bias) first broadcast the smaller operand with `ops.broadcast_to`. MindSpore's CPU Mul/Add with
  broadcasting keeps two int64 index arrays of the output's size for the life of the graph (4x the fp32 output), one
  pair per op instance, forward and backward: ~1.8 GiB of the 5.5 GiB peak at model=small
  (benchmarks/memory_timeline.py). The explicit broadcast is a transient copy from the memory pool instead.
- Reductions run on 2-D [rows, features] views: MindSpore's CPU ReduceSum/ReduceMean over the last axis of a 3-D or
  4-D tensor takes ~9x as long as over the same data viewed as 2-D (2.5 vs 0.3 ms at [8, 256, 384], 7.9 vs 0.9 ms at
  [8, 6, 256, 256]: kernels/probes/mindspore_ops.py), and autodiff turns every broadcast into such a reduction in the
  backward.
- The softmax gradient is written out (Softmax below): MindSpore's own holds int64 index arrays of the scores' size
  per layer on CPU.
Where the compiled CPU kernels apply (models/llama/kernels.py), their twins replace these cells first and this pass
finds nothing left to replace; with MINDLAB_KERNELS=plain it is what runs.
"""
import mindspore as ms
from mindspore import nn, ops
from mindspore.ops.auto_generate import RmsNorm, RotaryPositionEmbedding

from adapters import twins
from models.llama.model import AttentionBlock, RMSNorm, Rotary, apply_rope


class ColumnBroadcast(nn.Cell):
    """col [N, 1] -> [N, width of `like`]. `ops.tile` forward (MindSpore's CPU BroadcastTo along the columns takes
    5-8x as long: kernels/probes/mindspore_ops.py); the gradient is the 2-D row sums (the autodiff of either op reduces
    slower). 16 RMSNorms forward and backward at [2048, 384]: 61 -> 44 ms."""

    def __init__(self):
        super().__init__()
        self.tile, self.row_sum = ops.Tile(), ops.ReduceSum(keep_dims=True)

    def construct(self, col, like):
        return self.tile(col, (1, like.shape[-1]))

    def bprop(self, col, like, out, dout):
        return self.row_sum(dout, -1), ops.zeros_like(like)


class Softmax(nn.Cell):
    """softmax over the last axis, with its gradient out * (dout - sum(dout * out)) written out so the row sums
    are broadcast explicitly (MindSpore's own softmax gradient on CPU holds int64 index arrays of the scores'
    size per layer: 8 x 50 MiB at model=small)."""

    def __init__(self):
        super().__init__()
        self.softmax = ops.Softmax(-1)
        self.tile, self.row_sum = ops.Tile(), ops.ReduceSum(keep_dims=True)

    def construct(self, x):
        return self.softmax(x)

    def bprop(self, x, out, dout):
        shape = out.shape
        out, dout = out.reshape(-1, shape[-1]), dout.reshape(-1, shape[-1])  # 2-D reductions
        row_sums = self.row_sum(dout * out, -1)
        return ((out * (dout - self.tile(row_sums, (1, shape[-1])))).reshape(shape),)  # tile: ColumnBroadcast


class CpuRMSNorm(RMSNorm):
    """Rows [batch x sequence, hidden]; both products see operands of x's shape."""

    def __init__(self, base: RMSNorm):
        twins.adopt(self, base)
        self.broadcast_rows = ColumnBroadcast()

    def construct(self, x):
        shape = x.shape
        x32 = x.reshape(-1, shape[-1]).astype(ms.float32)
        inv_rms = self.rsqrt(self.add(self.mean(self.square(x32), -1), self.eps))
        normed = self.normalize(x32, self.broadcast_rows(inv_rms, x32))
        return self.scale(normed, ops.broadcast_to(self.weight, x32.shape)).reshape(shape).astype(x.dtype)


class CpuRotary(Rotary):
    """The tables broadcast to x's shape before the products."""

    def __init__(self, base: Rotary):
        twins.adopt(self, base)

    def construct(self, x, cos, sin):
        return apply_rope(x, ops.broadcast_to(cos, x.shape), ops.broadcast_to(sin, x.shape))


class CpuAttentionBlock(AttentionBlock):
    """The bias broadcast to the scores' shape; the softmax with its written-out gradient."""

    def __init__(self, base: AttentionBlock):
        twins.adopt(self, base)
        self.softmax_rows = Softmax()

    def construct(self, q, k, v, bias):
        scores = self.qk(q * self.scale, k).astype(ms.float32)
        scores = scores + ops.broadcast_to(bias, scores.shape)
        probs = self.softmax_rows(scores).astype(self.compute_dtype)
        return self.pv(probs, v)


class FusedRMSNorm(RMSNorm):
    """Ascend's RmsNorm: one kernel forward and one backward (MindFormers' LlamaRMSNorm uses it), in fp32."""

    def __init__(self, base: RMSNorm):
        twins.adopt(self, base)
        self.norm = RmsNorm(self.eps)

    def construct(self, x):
        return self.norm(x.astype(ms.float32), self.weight)[0].astype(x.dtype)


class FusedRotary(Rotary):
    """Ascend's RotaryPositionEmbedding (rotate-half mode) on q/k [B, heads, S, D], the tables [1, 1, S, D] or
    [B, 1, S, D] in x's dtype. MindSpore documents it as slow, and not to be used, where B x heads > 8 S (a decoding
    step's S = 1): there the plain products run."""

    def __init__(self, base: Rotary):
        twins.adopt(self, base)
        self.rotary = RotaryPositionEmbedding()

    def construct(self, x, cos, sin):
        b, heads, s, _ = x.shape
        if b * heads > 8 * s:
            return apply_rope(x, cos, sin)
        if cos.ndim == 2:
            cos, sin = cos.reshape((1, 1) + cos.shape), sin.reshape((1, 1) + sin.shape)
        return self.rotary(x, cos.astype(x.dtype), sin.astype(x.dtype), 0)


for _plain, _twin in ((RMSNorm, CpuRMSNorm), (Rotary, CpuRotary), (AttentionBlock, CpuAttentionBlock)):
    twins.register("cpu", _plain, _twin)
twins.register("ascend", RMSNorm, FusedRMSNorm)
twins.register("ascend-rope", Rotary, FusedRotary)
