"""model=small's GEMM shapes (8 x 256 tokens, H384, SwiGLU 1024, vocab 8192) by MindSpore's MatMul against oneDNN's
`dnnl_sgemm` (the libdnnl.so.3 MindSpore ships, which kernels/attention.cc already calls), split over two threads
by rows (M), columns (N) or the inner dimension (K, two partial products added).

    scripts/venv.sh python -m benchmarks.gemm_backends

MindSpore's time is ten MatMuls in one graph divided by ten (outputs kept, no copy to the host), so the launch is
not what is timed. Each line prints ms and GFLOP/s per product and the sgemm result's error against numpy's.
It asks whether a Linear kernel on sgemm (forward and both gradients) would pay: see the README's tenth pass.
"""
import ctypes
import os
import threading
import time

import numpy as np
import mindspore as ms
from mindspore import ops, nn, Tensor
ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
dnnl = ctypes.CDLL(os.path.join(os.path.dirname(ms.__file__), "lib", "libdnnl.so.3"))
f = dnnl.dnnl_sgemm
f.argtypes = [ctypes.c_char, ctypes.c_char, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
R = 10
class MM(nn.Cell):
    def __init__(self, ta, tb):
        super().__init__(); self.mm = ops.MatMul(transpose_a=ta, transpose_b=tb)
    def construct(self, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b):
        return tuple(self.mm(a, b) for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9))
def timeit(fn, reps):
    fn(); fn()
    t = time.perf_counter()
    for _ in range(reps): fn()
    return (time.perf_counter() - t) / reps
T, H, I, V = 2048, 384, 1024, 8192
shapes = [("fwd x W1^T", T, I, H, False, True), ("fwd x W2^T", T, H, I, False, True), ("fwd x Wq^T", T, H, H, False, True),
          ("fwd lm_head", T, V, H, False, True), ("dx dy W1", T, H, I, False, False), ("dW1 dy^T x", I, H, T, True, False),
          ("dx lm dy W", T, H, V, False, False), ("dW lm dy^T x", V, H, T, True, False), ("dWq", H, H, T, True, False)]
def run_threads(parts):
    ts = [threading.Thread(target=p) for p in parts[1:]]
    [t.start() for t in ts]; parts[0](); [t.join() for t in ts]
for name, M, N, K, ta, tb in shapes:
    rng = np.random.default_rng(0)
    As = [rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32) for _ in range(R)]
    A = As[0]
    B = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
    C = np.empty((M, N), np.float32)
    flop = 2 * M * N * K
    mm = MM(ta, tb); ts_ = [Tensor(a) for a in As]; b = Tensor(B)
    t_ms = timeit(lambda: mm(*ts_, b), 5) / R
    lda, ldb = A.shape[1], B.shape[1]
    TA, TB = (b'T' if ta else b'N'), (b'T' if tb else b'N')
    def split_m():
        def part(p):
            lo, hi = M * p // 2, M * (p + 1) // 2
            f(TA, TB, hi - lo, N, K, 1.0, A.ctypes.data + (lo if ta else lo * lda) * 4, lda, B.ctypes.data, ldb, 0.0, C.ctypes.data + lo * N * 4, N)
        run_threads([lambda: part(0), lambda: part(1)])
    def split_n():
        def part(p):
            lo, hi = N * p // 2, N * (p + 1) // 2
            f(TA, TB, M, hi - lo, K, 1.0, A.ctypes.data, lda, B.ctypes.data + (lo * ldb if tb else lo) * 4, ldb, 0.0, C.ctypes.data + lo * 4, N)
        run_threads([lambda: part(0), lambda: part(1)])
    C2 = np.empty((M, N), np.float32)
    def split_k():
        def part(p, out):
            lo, hi = K * p // 2, K * (p + 1) // 2
            aoff = (lo * lda if ta else lo) * 4; boff = (lo if tb else lo * ldb) * 4
            f(TA, TB, M, N, hi - lo, 1.0, A.ctypes.data + aoff, lda, B.ctypes.data + boff, ldb, 0.0, out.ctypes.data, N)
        run_threads([lambda: part(0, C), lambda: part(1, C2)])
        np.add(C, C2, out=C)
    ref = (A.T if ta else A) @ (B.T if tb else B)
    res = []
    for nm, fn in (("M", split_m), ("N", split_n), ("K", split_k)):
        t = timeit(fn, 10); err = np.abs(C - ref).max() / np.abs(ref).max(); res.append(f"{nm} {t*1e3:6.2f} ({flop/t/1e9:4.0f}) e{err:.0e}")
    print(f"{name:14s} M{M} N{N} K{K}: mindspore {t_ms*1e3:6.2f} ms ({flop/t_ms/1e9:4.0f} GF/s) | dnnl split " + " | ".join(res), flush=True)
