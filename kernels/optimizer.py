"""kernels/optimizer.cc as MindSpore ops on fp32 tensors:

    square_sum_op()(*tensors)                                       the sum of their squares [1]
    adamw_op()(hyper, decay, *params, *m, *v, *grads)               AdamW in place
        hyper = [lr, beta1, beta2, eps, decay_scale, factor] (float32 [6]), decay [n]: each parameter's

The update writes into the parameters and the moments, which MindSpore's graph cannot see from a custom op's
signature: the `side_effect_mem` attribute (as on MindSpore's Assign and AdamWeightDecay) makes the compiler keep the
call, though nothing reads its output, order it after the reads of the parameters that precede it, and hand the new
values to the other graphs that read them (tests/test_cpu_kernels.py checks the step against MindSpore's ops).
Unmarked, the next step's graph read the old weights (tests/test_step_reference.py with grad_accum=2 and
test_data_parallel.py failed). trainer/step.py ClipAndUpdate calls the norm, then the update inside the branch taken
when the step is allowed, as MindSpore's own optimizers are called: marked and in the forward's and backward's
graph, the op made MindSpore's CPU backend copy the Reshapes that follow the other custom kernels (~47 ms per
model=small step, by MindSpore's CPU profiler); the branch is a kernel graph of its own. The norm takes one
square_sum per gradient: one op over all of them compiled model=small's step 0.5-0.9 s sooner, but raised the
medium shape's peak RSS (benchmarks/speed_memory.py) from 2.45 to 3.21 GiB from the third step on.
"""
import mindspore as ms
from mindspore import ops

import kernels


def _op(name: str) -> ops.Custom:
    path, why = kernels.library("optimizer")
    if path is None:
        raise RuntimeError(why)
    return ops.Custom(f"{path}:mindlab_{name}", out_shape=lambda *shapes: [1], out_dtype=lambda *dtypes: ms.float32,
                      func_type="aot")


def square_sum_op() -> ops.Custom:
    return _op("square_sum")


def adamw_op() -> ops.Custom:
    op = _op("adamw")
    op.add_prim_attr("side_effect_mem", True)
    return op
