"""model=small's GEMM shapes (8 x 256 tokens, H384, SwiGLU 1024, vocab 8192) by MindSpore's MatMul against oneDNN's
`dnnl_sgemm` (the libdnnl.so.3 MindSpore ships, which kernels/attention.cc already calls), split over two threads
by rows (M), columns (N) or the inner dimension (K, two partial products added).

    scripts/venv.sh python -m benchmarks.gemm_backends

MindSpore's time is ten MatMuls in one graph divided by ten (outputs kept, no copy to the host), so the launch is
not what is timed. Each line prints ms and GFLOP/s per product (the best of 5 calls, cpu_matmul_peak's
best_seconds) and the sgemm result's error against numpy's. It asked whether a Linear kernel on sgemm (forward and
both gradients) would pay: the tenth pass's head alone gave nothing in the step; the twenty-fourth pass's every
Linear, split by M, is kernels/layers.cc's LinearKernel (benchmarks/HISTORY.md).
"""
import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from benchmarks.cpu_matmul_peak import best_seconds, sgemm_function, split_sgemm

T, H, I, V = 2048, 384, 1024, 8192
# (name, M, N, K, transpose A, transpose B): C [M, N] = op(A) op(B)
PRODUCTS = [("x W1^T", T, I, H, False, True), ("x W2^T", T, H, I, False, True), ("x Wq^T", T, H, H, False, True),
            ("lm_head", T, V, H, False, True), ("dx = dy W1", T, H, I, False, False),
            ("dW1 = dy^T x", I, H, T, True, False), ("lm dx = dy W", T, H, V, False, False),
            ("lm dW = dy^T x", V, H, T, True, False), ("dWq = dy^T x", H, H, T, True, False)]
REPEATS = 10  # MatMuls in MindSpore's one graph


class TenMatMuls(nn.Cell):
    def __init__(self, ta: bool, tb: bool):
        super().__init__()
        self.mm = ops.MatMul(transpose_a=ta, transpose_b=tb)

    def construct(self, lefts, b):
        return tuple(self.mm(a, b) for a in lefts)


def main() -> None:
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    sgemm = sgemm_function()
    for name, M, N, K, ta, tb in PRODUCTS:
        rng = np.random.default_rng(0)
        lefts = [rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32) for _ in range(REPEATS)]
        A, B = lefts[0], rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
        out, scratch = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
        gflops = lambda seconds: 2 * M * N * K / seconds / 1e9  # noqa: E731
        mm, ms_lefts, ms_b = TenMatMuls(ta, tb), tuple(Tensor(a) for a in lefts), Tensor(B)
        t = best_seconds(lambda: mm(ms_lefts, ms_b)) / REPEATS
        line = [f"{name:15s} M{M} N{N} K{K}: mindspore {t * 1e3:6.2f} ms ({gflops(t):4.0f} GF/s) | sgemm split"]
        ref = (A.T if ta else A) @ (B.T if tb else B)
        for axis in "MNK":
            t = best_seconds(lambda: split_sgemm(sgemm, A, B, ta, tb, axis, out, scratch))  # noqa: B023
            err = np.abs(out - ref).max() / np.abs(ref).max()
            line.append(f"{axis} {t * 1e3:6.2f} ({gflops(t):4.0f}) err {err:.0e}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
