"""Achieved fp32 matmul FLOP/s on this machine (MindSpore CPU kernels and numpy/OpenBLAS), to check the
`peak_tflops` that conf/device/cpu.yaml states for MFU.

    scripts/venv.sh python -m benchmarks.cpu_matmul_peak
"""
import boot  # noqa: F401

import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    for n in (1024, 2048, 4096):
        a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
        flops = 2 * n ** 3
        ta = Tensor(a)
        ms_s = best_seconds(lambda: ops.matmul(ta, ta).asnumpy())
        np_s = best_seconds(lambda: a @ a)
        print(f"n={n}: mindspore {flops / ms_s / 1e12:.3f} TFLOP/s, numpy {flops / np_s / 1e12:.3f} TFLOP/s")


if __name__ == "__main__":
    main()
