"""Achieved fp32 matmul FLOP/s on this machine: MindSpore's CPU kernel, PyTorch (OpenBLAS/oneDNN), numpy
(OpenBLAS) and oneDNN's sgemm as mindlab's kernels call it (kernels/sgemm.h: the rows split over the two cores,
one call each), square n x n GEMMs, best of 5 after a warm-up, 2 threads for PyTorch and oneDNN. The best of all is the
measured peak that benchmarks/speed_memory.py takes MFU against (conf/device/cpu.yaml's `peak_tflops` is a
datasheet figure: cores x clock x FLOPs/cycle). oneDNN's sgemm is among them because the native model's products run
on it (against MindSpore's 0.203 alone, its step measured 100% MFU at medium).

The table also prints the FMA units' own ceiling where gcc is present: a C loop of independent fused
multiply-adds on registers only (no memory traffic; `-O3 -march=native`, 16-float vectors), one thread per CPU,
their FLOP/s summed. A GEMM cannot beat it, so the measured peak's share of it says how far any GEMM-bound
step could still gain in fp32 (KVM hides the clock and the cycle counters: this is the direct way). Then a GEMM's
own inner loop alone (TILE_LOOP: a register tile of C fed from packed panels in cache, as BLIS-like GEMMs run it):
what a GEMM of our own could reach at best, before packing and cache misses: whether replacing MindSpore's MatMul
could pay.

    scripts/venv.sh python -m benchmarks.cpu_matmul_peak          # table
    scripts/venv.sh python -m benchmarks.cpu_matmul_peak --json   # {"mindspore": ..., "pytorch": ..., ...} FLOP/s
    scripts/venv.sh python -m benchmarks.cpu_matmul_peak --sizes 512,1024     # other n (default 1024,2048,4096)
"""
import boot  # noqa: F401

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops
from base.cpu_peak import best_seconds, rows_sgemm, sgemm_function
from benchmarks.results import recorded

SIZES = (1024, 2048, 4096)


def matmul_flops(sizes=SIZES, threads: int = 2) -> dict:
    """{library: {n: achieved FLOP/s}} for mindspore, pytorch (`threads` threads), numpy and onednn (its rows split
    over `threads` threads, one sgemm each: base/cpu_peak.py rows_sgemm)."""
    import torch

    torch.set_num_threads(threads)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    sgemm = sgemm_function()
    out = {"mindspore": {}, "pytorch": {}, "numpy": {}, "onednn": {}}
    for n in sizes:
        a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
        ta, tt, c = Tensor(a), torch.from_numpy(a), np.empty_like(a)
        flops = 2 * n ** 3
        out["mindspore"][n] = flops / best_seconds(lambda: ops.matmul(ta, ta).asnumpy())
        out["pytorch"][n] = flops / best_seconds(lambda: torch.mm(tt, tt))
        out["numpy"][n] = flops / best_seconds(lambda: a @ a)
        out["onednn"][n] = flops / best_seconds(lambda: rows_sgemm(sgemm, a, a, c, threads))
    return out


def measured_peak(sizes=SIZES, threads: int = 2) -> dict:
    """{library: best FLOP/s over `sizes`, "peak": the best of all, "by": its library, "sizes": `sizes`}."""
    best = {lib: max(by_n.values()) for lib, by_n in matmul_flops(sizes, threads).items()}
    by = max(best, key=best.get)
    return {**best, "peak": best[by], "by": by, "sizes": list(sizes)}


# The two ceilings' C programs: `run` (one per thread, each writing its FLOP/s) and a main that sums them.
C_MAIN = r"""
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  int n = atoi(argv[1]); iters = atol(argv[2]);
  pthread_t t[64]; double flops[64], total = 0;
  for (int i = 0; i < n; ++i) pthread_create(&t[i], 0, run, &flops[i]);
  for (int i = 0; i < n; ++i) { pthread_join(t[i], 0); total += flops[i]; }
  printf("%f\n", total);
  return 0;
}
"""
C_HEAD = r"""
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <time.h>
typedef float v16 __attribute__((vector_size(64)));
static long iters;
static double now(void);
"""
FMA_LOOP = C_HEAD + r"""
enum { CHAINS = 12 };  /* independent accumulators: more than FMA latency x units, so the units never wait */
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
""" + C_MAIN
# A GEMM's inner loop: a 14 x 32 tile of C in 28 vector registers, updated by one column of a packed A panel
# (14 floats, each broadcast) times one row of a packed B panel (two vectors) per step; the panels (KC steps, 46 KB)
# stay in cache, so the loads are from L1/L2 and nothing else (packing, edges, C's reads) is counted.
TILE_LOOP = C_HEAD + r"""
enum { MR = 14, KC = 256 };
static void* run(void* out) {
  float* a = aligned_alloc(64, sizeof(float) * MR * KC);
  v16* b = aligned_alloc(64, sizeof(v16) * 2 * KC);
  v16 c[MR][2];
  for (int i = 0; i < MR * KC; ++i) a[i] = 1e-3f * (i % 7);
  for (int i = 0; i < 2 * KC; ++i) for (int j = 0; j < 16; ++j) b[i][j] = 1e-3f * j;
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = b[0] * 0.0f;
  double start = now();
  for (long r = 0; r < iters; ++r)
    for (int k = 0; k < KC; ++k) {
      v16 b0 = b[2 * k], b1 = b[2 * k + 1];
#pragma GCC unroll 14
      for (int i = 0; i < MR; ++i) { c[i][0] += a[k * MR + i] * b0; c[i][1] += a[k * MR + i] * b1; }
    }
  double seconds = now() - start;
  float sum = 0; for (int i = 0; i < MR; ++i) sum += c[i][0][0] + c[i][1][0];
  *(double*)out = iters * KC * MR * 32 * 2.0 / seconds + 0 * sum;
  free(a); free(b);
  return 0;
}
""" + C_MAIN
CEILINGS = {"fma": (FMA_LOOP, 150_000_000), "gemm tile": (TILE_LOOP, 300_000)}  # (program, iterations)


def ceiling(kind: str, threads: int) -> float:
    """FLOP/s of CEILINGS[kind]'s program on `threads` threads (best of 3), or 0.0 without gcc."""
    if shutil.which("gcc") is None:
        return 0.0
    program, iters = CEILINGS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = os.path.join(tmp, "ceiling.c"), os.path.join(tmp, "ceiling")
        with open(source, "w") as f:
            f.write(program)
        subprocess.run(["gcc", "-O3", "-march=native", source, "-o", binary, "-lpthread"], check=True)
        return max(float(subprocess.run([binary, str(threads), str(iters)], check=True, capture_output=True,
                                        text=True).stdout) for _ in range(3))


def main(sizes) -> None:
    table = matmul_flops(sizes)
    for n in sizes:
        print(f"n={n}: " + ", ".join(f"{lib} {by_n[n] / 1e12:.3f} TFLOP/s" for lib, by_n in table.items()))
    best = max((f, lib) for lib, by_n in table.items() for f in by_n.values())
    print(f"measured peak: {best[0] / 1e12:.3f} TFLOP/s ({best[1]})")
    fma, tile = ceiling("fma", os.cpu_count()), ceiling("gemm tile", os.cpu_count())
    if not fma:
        print("FMA and GEMM tile ceilings: not measured (no gcc)")
        return
    print(f"FMA ceiling ({os.cpu_count()} threads of register-only fused multiply-adds): {fma / 1e12:.3f} TFLOP/s; "
          f"the measured peak is {best[0] / fma:.0%} of it")
    print(f"GEMM tile ceiling (a 14 x 32 register tile fed from cached panels, {os.cpu_count()} threads): "
          f"{tile / 1e12:.3f} TFLOP/s, {tile / fma:.0%} of the FMA ceiling; the measured peak is {best[0] / tile:.0%} "
          "of it")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print measured_peak() as JSON alone (for another "
                        "benchmark to parse; RESULTS.md is left as it is)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="the n of the n x n GEMMs, comma-separated")
    args = parser.parse_args()
    n = tuple(int(v) for v in args.sizes.split(","))
    if args.json:
        print(json.dumps(measured_peak(n)))
    else:
        with recorded("benchmarks.cpu_matmul_peak", "This machine's fp32 GEMM peak"):
            main(n)
