"""The fused CPU attention kernel (kernels/attention.cc) against the plain path, at one shape:

    scripts/venv.sh python -m benchmarks.attention_kernel [--batch 8 --seq 256 --heads 6 --head-dim 64] [--steps 12]
    (--heads and --head-dim shape the core's timing only; the step is model=small's: 6 heads of 64)

1. The attention core alone, forward + backward in graph mode: the plain path (models/llama/model.py
   CoreAttention on [B, heads, S, D]) and the kernel (kernels/attention.py on [B, S, heads, D]); median ms.
2. A whole training step of model=small (--batch x --seq tokens) with each kernel, both built in this process and
   their steps alternating (benchmarks/step_variants.py): wall and CPU ms per step.
"""
import argparse
import statistics
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from benchmarks.step_variants import print_steps, step_ms


class _SumOfCore(nn.Cell):
    def __init__(self, core, fused: bool):
        super().__init__()
        self.core, self.fused = core, fused

    def construct(self, q, k, v, segments):
        return (self.core(q, k, v, segments) if self.fused else self.core(q, k, v)).sum()


class _Gradients(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net, self.grad = net, ops.GradOperation(get_all=True)

    def construct(self, *inputs):
        return self.grad(self.net)(*inputs)


def core_ms(fused: bool, b: int, s: int, h: int, d: int, repeats: int) -> float:
    from kernels.attention import FusedAttention
    from models.llama.model import CoreAttention

    shape = (b, s, h, d) if fused else (b, h, s, d)
    core = FusedAttention() if fused else CoreAttention(d, ms.float32)
    rng = np.random.default_rng(0)
    q, k, v = (Tensor(rng.standard_normal(shape, dtype=np.float32)) for _ in range(3))
    grads = _Gradients(_SumOfCore(core, fused))
    times = []
    for _ in range(repeats + 3):  # the first calls compile
        start = time.perf_counter()
        grads(q, k, v, Tensor(np.zeros((b, s), np.int32)))[0].asnumpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    shape = f"[{args.batch}, {args.seq}, {args.heads}, {args.head_dim}]"
    for fused in (False, True):
        print(f"attention core {shape}, forward + backward: {'fused' if fused else 'plain'} "
              f"{core_ms(fused, args.batch, args.seq, args.heads, args.head_dim, 20):.2f} ms", flush=True)
    common = ["model=small", f"data.seq_len={args.seq}", f"trainer.micro_batch_size={args.batch}"]
    variants = {kernel: [f"model.attention_kernel={kernel}"] for kernel in ("plain", "fused")}
    print_steps(step_ms(variants, common, args.steps), f"model=small step ({args.batch} x {args.seq} tokens)")


if __name__ == "__main__":
    main()
