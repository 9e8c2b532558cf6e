"""kernels/attention.cc as a MindSpore cell: causal self-attention on CPU, fp32, in the [B, S, heads, D] layout.

    out = FusedAttention()(q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, D], segments [B, S] int32)

Query i attends to key j <= i of the same segment (packed samples; one segment id for a plain sequence); H is a
multiple of Hkv (grouped-query attention without repeating K/V). The forward op returns the output and each
row's logsumexp; the backward op recomputes the probabilities from them, so what autodiff keeps for the
backward is q, k, v, the output and lse [B, H, S], never a [S, S] array. Both ops are `ops.Custom` AOT
kernels; the gradient is registered on the forward op (`bprop`), which sees its logsumexp output.
"""
from mindspore import nn, ops

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
