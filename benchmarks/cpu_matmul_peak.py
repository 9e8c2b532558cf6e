"""Achieved fp32 matmul FLOP/s on this machine: MindSpore's CPU kernel, PyTorch (OpenBLAS/oneDNN) and numpy
(OpenBLAS), square n x n GEMMs, best of 5 after a warm-up, 2 threads for PyTorch. The best of all is the
measured peak that benchmarks/speed_memory.py takes MFU against (conf/device/cpu.yaml's `peak_tflops` is a
datasheet figure: cores x clock x FLOPs/cycle).

    scripts/venv.sh python -m benchmarks.cpu_matmul_peak          # table
    scripts/venv.sh python -m benchmarks.cpu_matmul_peak --json   # {"mindspore": ..., "pytorch": ..., ...} FLOP/s
"""
import boot  # noqa: F401

import json
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

SIZES = (1024, 2048, 4096)


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_flops(sizes=SIZES, threads: int = 2) -> dict:
    """{library: {n: achieved FLOP/s}} for mindspore, pytorch (`threads` threads) and numpy."""
    import torch

    torch.set_num_threads(threads)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    out = {"mindspore": {}, "pytorch": {}, "numpy": {}}
    for n in sizes:
        a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
        ta, tt = Tensor(a), torch.from_numpy(a)
        flops = 2 * n ** 3
        out["mindspore"][n] = flops / best_seconds(lambda: ops.matmul(ta, ta).asnumpy())
        out["pytorch"][n] = flops / best_seconds(lambda: torch.mm(tt, tt))
        out["numpy"][n] = flops / best_seconds(lambda: a @ a)
    return out


def measured_peak(sizes=SIZES, threads: int = 2) -> dict:
    """{library: best FLOP/s over `sizes`, "peak": the best of all, "by": its library}."""
    best = {lib: max(by_n.values()) for lib, by_n in matmul_flops(sizes, threads).items()}
    by = max(best, key=best.get)
    return {**best, "peak": best[by], "by": by}


def main() -> None:
    if "--json" in sys.argv:
        print(json.dumps(measured_peak()))
        return
    table = matmul_flops()
    for n in SIZES:
        print(f"n={n}: " + ", ".join(f"{lib} {by_n[n] / 1e12:.3f} TFLOP/s" for lib, by_n in table.items()))
    best = max((f, lib) for lib, by_n in table.items() for f in by_n.values())
    print(f"measured peak: {best[0] / 1e12:.3f} TFLOP/s ({best[1]})")


if __name__ == "__main__":
    main()
