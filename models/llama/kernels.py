"""The CPU kernel overlay of the native Llama: twins of models/llama/model.py's cells that compute the same thing
with kernels/ (MindSpore AOT custom ops, CPU, fp32). models/llama/__init__.py decides from the config which
libraries apply (kernel_libraries) and swaps the twins in after the build (adapters/twins.py overlay); the model
file stays plain MindSpore, which is what runs on Ascend/GPU, in fp16/bf16, under a tp/pp plan (plan.py sets its
strategies on the plain primitives) and with MINDLAB_KERNELS=plain.

    kernels/attention.cc  (model.attention_kernel)  Attention -> KernelAttention, LlamaModel -> KernelLayoutLlamaModel
    kernels/layers.cc     (model.layer_kernels)     Linear -> KernelLinear, RMSNorm -> KernelRMSNorm,
                                                    FeedForward -> KernelFeedForward, Rotary -> KernelRotary
                                                    (and the objectives' token cross-entropy: objectives/_cross_entropy.py)

Attention: the fused kernel works on the projections' own [B, S, heads, D] layout, reads each query head's kv head
itself, masks by segment id, skips the keys after each block of query rows and keeps only each row's logsumexp for
the backward; the plain path (CoreAttention) transposes to [B, heads, S, D], repeats the kv heads and keeps the
[S, S] probabilities. Both give the same loss and gradients (tests/test_cpu_kernels.py). A decoding step
(generation) is one op a layer, RoPE and the cache write included (DecodeAttention).

RMSNorm, SwiGLU and RoPE: kernels/layers.cc does each in one pass forward and one backward, where the MindSpore ops
take 5-12 kernels and as many temporaries (the RMSNorm keeps only its input and each row's 1/rms for the backward).
With them, a Linear's products are kernels/layers.cc's too: oneDNN's sgemm with a range of rows per core, faster
than MindSpore's MatMul at a training step's shapes, and over one row (a decoding step at batch 1) a loop that reads
the weights once, in order, faster than MatMul there.
"""
import mindspore as ms
from mindspore import ops

from adapters import twins
from kernels.attention import DecodeAttention, FusedAttention
from kernels.layers import LinearKernel, RMSNormKernel, RoPEKernel, RowLinearKernel, SwiGLUKernel
from models.llama.model import Attention, FeedForward, Linear, LlamaModel, RMSNorm, Rotary

# Rows of x from which KernelLinear is kernels/layers.cc's sgemm product (LinearKernel): below it (a decoding step's
# few rows) the product splits a wide weight's reads over the cores and trails MatMul (at [8, 512] x [512, 32000]
# 8.2 ms against 5.0); from 64 rows on it is level or ahead (16.0 against 16.2, at 256 rows 43 against 55;
# measured on a 2-core AMD EPYC).
KERNEL_ROWS = 64


class KernelLinear(Linear):
    """One row of x (a decoding step at batch 1): the one-row product (RowLinearKernel, fp32); KERNEL_ROWS rows or
    more (a training step, a prefill): the sgemm product (LinearKernel); in between, MatMul."""

    def __init__(self, base: Linear):
        twins.adopt(self, base)
        self.one_row = RowLinearKernel()
        self.product = LinearKernel()

    def construct(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).astype(self.compute_dtype)
        if x.shape[0] == 1:
            y = self.one_row(x.astype(ms.float32), self.weight).astype(self.compute_dtype)
        elif x.shape[0] >= KERNEL_ROWS:
            y = self.product(x, self.weight)
        else:
            y = self.matmul(x, self.weight.astype(self.compute_dtype))
        return y.reshape(shape[:-1] + (-1,))


class KernelRMSNorm(RMSNorm):
    def __init__(self, base: RMSNorm):
        twins.adopt(self, base)
        self.kernel = RMSNormKernel(self.eps)

    def construct(self, x):
        return self.kernel(x.astype(ms.float32), self.weight).astype(x.dtype)


class KernelFeedForward(FeedForward):
    """silu(w1 x) * w3 x as one op."""

    def __init__(self, base: FeedForward):
        twins.adopt(self, base)
        self.swiglu = SwiGLUKernel()

    def construct(self, x):
        return self.w2(self.swiglu(self.w1(x), self.w3(x)))


class KernelRotary(Rotary):
    """RoPE in either layout the attention passes: q/k [B, heads, S, D] with tables [S, D] or [B, 1, S, D], or
    [B, S, heads, D] with [S, 1, D] or [B, S, 1, D] (KernelAttention)."""

    def __init__(self, base: Rotary):
        twins.adopt(self, base)
        self.kernel = RoPEKernel()

    def construct(self, x, cos, sin):
        return self.kernel(x, cos, sin)


class KernelAttention(Attention):
    """The fused attention on [B, S, heads, D]: no head transposes and no GQA repeats; `mask` is the segment ids
    [B, S] (KernelLayoutLlamaModel) instead of a bias, cos/sin are [S, 1, D] or [B, S, 1, D]. A decoding step
    (`cached` with a slot) is one DecodeAttention op, which reads only the cache columns up to the slot (the bias
    hides the later ones anyway); a prefill is the plain path's."""

    def __init__(self, base: Attention):
        twins.adopt(self, base)
        self.core = FusedAttention()
        self.decode = DecodeAttention()

    def construct(self, x, cos, sin, mask=None):
        b, s, _ = x.shape
        q, k, v = self.heads(x)
        out = self.core(self.rope(q, cos, sin), self.rope(k, cos, sin), v, mask)
        return self.wo(out.reshape(b, s, -1))

    def cached(self, x, cos, sin, bias, k_cache=None, v_cache=None, slot=None):
        if slot is None:  # prefill, or no cache: the plain path
            return super(KernelAttention, self).cached(x, cos, sin, bias, k_cache, v_cache, slot)
        b, s, _ = x.shape
        q, k, v = self.heads(x)
        return self.wo(self.decode(q, k, v, cos, sin, k_cache, v_cache, slot, bias).reshape(b, s, -1))


class KernelLayoutLlamaModel(LlamaModel):
    """The attention inputs of KernelAttention's layout: the tables broadcast over the heads' axis 2, and the
    segment ids as the mask (the kernel masks by segment itself; one segment for a plain sequence)."""

    def __init__(self, base: LlamaModel):
        twins.adopt(self, base)

    def attention_inputs(self, tokens, positions, segments):
        seq = tokens.shape[1]
        if positions is None:
            cos, sin = self.cos[:seq].expand_dims(1), self.sin[:seq].expand_dims(1)  # [S, 1, D]
        else:
            cos, sin = self.cos[positions].expand_dims(2), self.sin[positions].expand_dims(2)  # [B, S, 1, D]
        mask = ops.zeros(tokens.shape, ms.int32) if segments is None else segments.astype(ms.int32)
        return cos, sin, mask


for _plain, _twin in ((Attention, KernelAttention), (LlamaModel, KernelLayoutLlamaModel)):
    twins.register("attention", _plain, _twin)
for _plain, _twin in ((Linear, KernelLinear), (RMSNorm, KernelRMSNorm), (FeedForward, KernelFeedForward),
                      (Rotary, KernelRotary)):
    twins.register("layers", _plain, _twin)
