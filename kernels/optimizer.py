"""kernels/optimizer.cc as a MindSpore op: AdamW's in-place update of one fp32 parameter and its moments.

    adamw_op()(param, m, v, grad, hyper)   hyper = [lr, beta1, beta2, eps, decay] (float32 [5])

It writes into its first three inputs, which MindSpore's graph cannot see from a custom op's signature: the
`side_effect_mem` attribute (as on MindSpore's Assign and AdamWeightDecay) makes the compiler keep the call,
though nothing reads its output, and order it after the reads of the parameter that precede it
(tests/test_cpu_kernels.py checks the update, a skipped step and the order against MindSpore's kernel).
"""
import mindspore as ms
from mindspore import ops

import kernels


def adamw_op() -> ops.Custom:
    path, why = kernels.library("optimizer")
    if path is None:
        raise RuntimeError(why)
    op = ops.Custom(f"{path}:mindlab_adamw", out_shape=lambda *shapes: [1], out_dtype=lambda *dtypes: ms.float32,
                    func_type="aot")
    op.add_prim_attr("side_effect_mem", True)
    return op
