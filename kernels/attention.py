"""kernels/attention.cc as MindSpore cells: causal self-attention on CPU, fp32, in the [B, S, heads, D] layout, for
training, and one decoding step against a KV cache, for generation.

    out = FusedAttention()(q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, D], segments [B, S] int32)
    out = DecodeAttention()(q, k, v, cos, sin, k_cache, v_cache, slot, bias)  # writes the caches' column

Query i attends to key j <= i of the same segment (packed samples; one segment id for a plain sequence); H is a
multiple of Hkv (grouped-query attention without repeating K/V). The forward op returns the output and each
row's logsumexp; the backward op recomputes the probabilities from them, so what autodiff keeps for the
backward is q, k, v, the output and lse [B, H, S], never a [S, S] array. Both ops are `ops.Custom` AOT
kernels; the gradient is registered on the forward op (`bprop`), which sees its logsumexp output.
"""
from mindspore import nn, ops
from mindspore.ops import signature as sig

import kernels


def _forward_shapes(q, k, v, segments):
    return q, [q[0], q[2], q[1]]


def _forward_dtypes(q, k, v, segments):
    return q, q


class FusedAttention(nn.Cell):
    def __init__(self):
        super().__init__()
        path, why = kernels.library("attention")
        if path is None:
            raise RuntimeError(why)
        backward = ops.Custom(f"{path}:mindlab_attention_backward", out_shape=lambda q, k, v, s, o, l, d: (q, k, v),
                              out_dtype=lambda q, k, v, s, o, l, d: (q, k, v), func_type="aot")
        zeros_like = ops.ZerosLike()

        def bprop(q, k, v, segments, out, dout):
            dq, dk, dv = backward(q, k, v, segments, out[0], out[1], dout[0])
            return dq, dk, dv, zeros_like(segments)

        self.forward = ops.Custom(f"{path}:mindlab_attention_forward", out_shape=_forward_shapes,
                                  out_dtype=_forward_dtypes, func_type="aot", bprop=bprop)

    def construct(self, q, k, v, segments):
        return self.forward(q, k, v, segments)[0]


class _DecodeOp(ops.Custom):
    """The decoding op, its two caches declared written (RW_WRITE), as MindSpore's own in-place ops (Assign) declare
    theirs: the graph then orders the op among its other reads and writes of those Parameters, and the kernel
    writes into their memory."""
    __mindspore_signature__ = tuple(sig.make_sig(name, sig.sig_rw.RW_WRITE if name.endswith("cache") else
                                                 sig.sig_rw.RW_READ)
                                    for name in ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slot", "bias"))


class DecodeAttention(nn.Cell):
    """One new token per row (q [B, 1, H, D], k and v [B, 1, Hkv, D], before RoPE; cos and sin [B, 1, 1, D] at its
    position) against the caches k_cache and v_cache [B, Hkv, L, D], Parameters: the token's rotated k and its v
    are written in place at the column where slot [1, 1, L, 1] is true, and its query attends to that column and
    the ones before it under bias [B, 1, 1, L] (the later ones, not yet written, are not read). Returns out
    [B, 1, H, D]: what LlamaModel's plain cached path computes in ~9 kernels a layer (RoPE twice, two cache
    writes, scores, mask, softmax, product), in one, and without copying the caches. Inference only: no
    gradient."""

    def __init__(self):
        super().__init__()
        path, why = kernels.library("attention")
        if path is None:
            raise RuntimeError(why)
        self.op = _DecodeOp(f"{path}:mindlab_decode_attention", out_shape=lambda q, *_: q,
                            out_dtype=lambda q, *_: q, func_type="aot")

    def construct(self, q, k, v, cos, sin, k_cache, v_cache, slot, bias):
        return self.op(q, k, v, cos, sin, k_cache, v_cache, slot, bias)
