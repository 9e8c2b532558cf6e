"""Achieved fp32 matmul FLOP/s on this machine: MindSpore's CPU kernel, PyTorch (OpenBLAS/oneDNN) and numpy
(OpenBLAS), square n x n GEMMs, best of 5 after a warm-up, 2 threads for PyTorch. The best of all is the
measured peak that benchmarks/speed_memory.py takes MFU against (conf/device/cpu.yaml's `peak_tflops` is a
datasheet figure: cores x clock x FLOPs/cycle).

The table also prints the FMA units' own ceiling where gcc is present: a C loop of independent fused
multiply-adds on registers only (no memory traffic; `-O3 -march=native`, 16-float vectors), one thread per CPU,
their FLOP/s summed. A GEMM cannot beat it, so the measured peak's share of it says how far any GEMM-bound
step could still gain in fp32 (KVM hides the clock and the cycle counters: this is the direct way).

    scripts/venv.sh python -m benchmarks.cpu_matmul_peak          # table
    scripts/venv.sh python -m benchmarks.cpu_matmul_peak --json   # {"mindspore": ..., "pytorch": ..., ...} FLOP/s
"""
import boot  # noqa: F401

import json
import os
import shutil
import subprocess
import sys
import tempfile
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


FMA_LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <time.h>
typedef float v16 __attribute__((vector_size(64)));
enum { CHAINS = 12 };  /* independent accumulators: more than FMA latency x units, so the units never wait */
static long iters;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void* run(void* out) {
  v16 acc[CHAINS], a, b;
  for (int j = 0; j < 16; ++j) { a[j] = 0.9999f; b[j] = 1e-4f; }
  for (int i = 0; i < CHAINS; ++i) acc[i] = a * (float)i;
  double start = now();
  for (long k = 0; k < iters; ++k)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = acc[i] * a + b;  /* unrolled: the accumulators stay in registers */
  double seconds = now() - start;
  float sum = 0; for (int i = 0; i < CHAINS; ++i) sum += acc[i][0];
  *(double*)out = iters * CHAINS * 16 * 2.0 / seconds + 0 * sum;  /* sum used: the loop is not dropped */
  return 0;
}
int main(int argc, char** argv) {
  int n = atoi(argv[1]); iters = atol(argv[2]);
  pthread_t t[64]; double flops[64], total = 0;
  for (int i = 0; i < n; ++i) pthread_create(&t[i], 0, run, &flops[i]);
  for (int i = 0; i < n; ++i) { pthread_join(t[i], 0); total += flops[i]; }
  printf("%f\n", total);
  return 0;
}
"""


def fma_ceiling(threads: int) -> float:
    """FLOP/s of FMA_LOOP on `threads` threads (best of 3), or 0.0 without gcc."""
    if shutil.which("gcc") is None:
        return 0.0
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma")
        with open(source, "w") as f:
            f.write(FMA_LOOP)
        subprocess.run(["gcc", "-O3", "-march=native", source, "-o", binary, "-lpthread"], check=True)
        return max(float(subprocess.run([binary, str(threads), "150000000"], check=True, capture_output=True,
                                        text=True).stdout) for _ in range(3))


def main() -> None:
    if "--json" in sys.argv:
        print(json.dumps(measured_peak()))
        return
    table = matmul_flops()
    for n in SIZES:
        print(f"n={n}: " + ", ".join(f"{lib} {by_n[n] / 1e12:.3f} TFLOP/s" for lib, by_n in table.items()))
    best = max((f, lib) for lib, by_n in table.items() for f in by_n.values())
    print(f"measured peak: {best[0] / 1e12:.3f} TFLOP/s ({best[1]})")
    ceiling = fma_ceiling(os.cpu_count())
    if ceiling:
        print(f"FMA ceiling ({os.cpu_count()} threads of register-only fused multiply-adds): {ceiling / 1e12:.3f} "
              f"TFLOP/s; the measured peak is {best[0] / ceiling:.0%} of it")
    else:
        print("FMA ceiling: not measured (no gcc)")


if __name__ == "__main__":
    main()
