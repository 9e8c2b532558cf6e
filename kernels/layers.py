"""kernels/layers.cc as MindSpore ops: RMSNorm, SwiGLU, RoPE and token cross-entropy on CPU in fp32, each one
custom op forward and one backward (registered as the forward op's `bprop`).

    RMSNormKernel(eps)(x [..., H], weight [H])      x / sqrt(mean(x^2) + eps) * weight
    SwiGLUKernel()(gate, up)                        silu(gate) * up
    RoPEKernel()(x [..., D], cos, sin)              x cos + rotate_half(x) sin, cos/sin broadcastable to x
    CrossEntropyKernel()(logits [N, V], targets [N]) -log softmax(logits)[target] per row [N] (0 where the
                                                    target is outside [0, V))
    LinearKernel()(x [..., K], weight [N, K])       x @ weight^T by sgemm, each gradient one op of its own
                                                    (models/llama/kernels.py KernelLinear: a training step's products)
    RowLinearKernel()(x [1, K], weight [N, K])      x @ weight^T for one row: a decoding step's projections at
                                                    batch 1 (models/llama/kernels.py KernelLinear)

What autodiff keeps for the backward: RMSNorm's input and each row's 1/rms [rows] (its output, like the attention
kernel's logsumexp); SwiGLU's two inputs (the sigmoid is recomputed); RoPE nothing but the tables (its gradient is
the transposed rotation of the output gradient); the cross-entropy its logits and each row's logsumexp, its backward
writing (softmax - onehot) x the row's gradient in one pass. cos/sin are constants: their gradients are zeros, as are
the targets'. LinearKernel keeps x and the weight, like MatMul; its gradients dy W and dy^T x are two ops, so a
frozen weight's (LoRA's base) is left out of the graph. RowLinearKernel's gradient is MindSpore's two MatMuls (it is
built for inference; the gradient keeps it correct wherever a one-row product is trained).
"""
import mindspore as ms
import numpy as np
from mindspore import nn, ops

import kernels


def _op(name: str, out_shape, out_dtype, bprop=None):
    path, why = kernels.library("layers")
    if path is None:
        raise RuntimeError(why)
    return ops.Custom(f"{path}:mindlab_{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot",
                      bprop=bprop)


class RMSNormKernel(nn.Cell):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = ms.Tensor(np.array([eps], np.float32))
        backward = _op("rms_norm_backward", lambda x, w, inv, dy: (x, w), lambda x, w, inv, dy: (x, w))
        zeros_like = ops.ZerosLike()

        def bprop(x, weight, eps, out, dout):
            dx, dweight = backward(x, weight, out[1], dout[0])
            return dx, dweight, zeros_like(eps)

        self.forward = _op("rms_norm_forward", lambda x, w, e: (x, x[:-1]), lambda x, w, e: (x, x), bprop)

    def construct(self, x, weight):
        return self.forward(x, weight, self.eps)[0]


class SwiGLUKernel(nn.Cell):
    def __init__(self):
        super().__init__()
        backward = _op("swiglu_backward", lambda g, u, dy: (g, g), lambda g, u, dy: (g, g))

        def bprop(gate, up, out, dout):
            return backward(gate, up, dout)

        self.forward = _op("swiglu_forward", lambda g, u: g, lambda g, u: g, bprop)

    def construct(self, gate, up):
        return self.forward(gate, up)


class RoPEKernel(nn.Cell):
    def __init__(self):
        super().__init__()
        backward = _op("rope_backward", lambda dy, c, s: dy, lambda dy, c, s: dy)
        zeros_like = ops.ZerosLike()

        def bprop(x, cos, sin, out, dout):
            return backward(dout, cos, sin), zeros_like(cos), zeros_like(sin)

        self.forward = _op("rope_forward", lambda x, c, s: x, lambda x, c, s: x, bprop)

    def construct(self, x, cos, sin):
        return self.forward(x, cos, sin)


class CrossEntropyKernel(nn.Cell):
    def __init__(self):
        super().__init__()
        backward = _op("cross_entropy_backward", lambda x, t, lse, dnll: x, lambda x, t, lse, dnll: x)
        zeros_like = ops.ZerosLike()

        def bprop(logits, targets, out, dout):
            return backward(logits, targets, out[1], dout[0]), zeros_like(targets)

        self.forward = _op("cross_entropy_forward", lambda x, t: (t, t), lambda x, t: (x, x), bprop)

    def construct(self, logits, targets):
        return self.forward(logits, targets)[0]


class RowLinearKernel(nn.Cell):
    def __init__(self):
        super().__init__()
        input_grad, weight_grad = ops.MatMul(), ops.MatMul(transpose_a=True)

        def bprop(x, weight, out, dout):
            return input_grad(dout, weight), weight_grad(dout, x)

        self.forward = _op("row_linear", lambda x, w: [x[0], w[0]], lambda x, w: x, bprop)

    def construct(self, x, weight):
        return self.forward(x, weight)


class LinearKernel(nn.Cell):
    def __init__(self):
        super().__init__()
        input_grad = _op("linear_input_grad", lambda dy, w: dy[:-1] + [w[1]], lambda dy, w: dy)
        weight_grad = _op("linear_weight_grad", lambda dy, x: [dy[-1], x[-1]], lambda dy, x: dy)

        def bprop(x, weight, out, dout):
            return input_grad(dout, weight), weight_grad(dout, x)

        self.forward = _op("linear", lambda x, w: x[:-1] + [w[0]], lambda x, w: x, bprop)

    def construct(self, x, weight):
        return self.forward(x, weight)
