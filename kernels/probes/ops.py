"""Each compiled CPU kernel (kernels/*.cc) on its own at model=small's shapes, called through ctypes: no MindSpore
graph, no launch, so what is timed is the kernel's own loop (its threads included).

    scripts/venv.sh python -m kernels.probes.ops [--calls 20] [--rounds 3] [--only adamw,rope_forward]
        [--compare LIBRARY=PATH ...] [--seq-len 256]

Prints per op the best and the median ms of --calls calls. `--compare attention=/tmp/attention.so` times that build
of kernels/attention.cc too (any library built from a changed copy of the source, with kernels/__init__.py's
command), its calls alternating with the venv's build round by round, and prints the largest difference between their
outputs: an A/B of a kernel change (it showed AdamW's update and RoPE running scalar code, and a rewrite of the
attention's products no faster than the sgemm it replaced). `--seq-len` sets the attention's rows' length, 2048 tokens
of rows (8 x 256 by default) and one row from 2048 up. A kernel's time here is a floor: in a training step its inputs
come from memory, not from cache (MindSpore's CPU profiler gives the in-step times).
"""
import argparse
import ctypes
import statistics
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

import kernels

B, S, HEADS, D, HIDDEN, FFN, VOCAB, LAYERS = 8, 256, 6, 64, 384, 1024, 8192, 8  # model=small, 8 x 256 tokens
TOKENS = B * S


def small_parameter_shapes() -> List[Tuple[int, ...]]:
    """model=small's 75 trainable tensors: embedding, per layer q k v o, w1 w3 w2 and two norms, final norm, head."""
    layer = [(HIDDEN, HIDDEN)] * 4 + [(FFN, HIDDEN)] * 2 + [(HIDDEN, FFN), (HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN)] + layer * LAYERS + [(HIDDEN,), (VOCAB, HIDDEN)]


# a backward's inputs include its forward's outputs (the same arrays): the forward runs once first to fill them
FORWARD_OF = {"attention_backward": "attention_forward", "rms_norm_backward": "rms_norm_forward",
              "cross_entropy_backward": "cross_entropy_forward"}


def _inputs(rng: np.random.Generator, seq_len: int = S) -> Dict[str, Tuple[str, List[np.ndarray], slice]]:
    """{op: (library, arrays: inputs then outputs, the arrays it writes)}; the attention's rows are seq_len long,
    max(1, TOKENS // seq_len) of them."""
    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    rows = max(1, TOKENS // seq_len)
    q, k, v, dout = (normal(rows, seq_len, HEADS, D) for _ in range(4))
    segments = np.zeros((rows, seq_len), np.int32)
    o, lse = np.zeros_like(q), np.zeros((rows, HEADS, seq_len), np.float32)
    x, gate, up, logits = normal(TOKENS, HIDDEN), normal(TOKENS, FFN), normal(TOKENS, FFN), normal(TOKENS, VOCAB)
    weight, inv_rms = np.ones(HIDDEN, np.float32), np.zeros(TOKENS, np.float32)
    targets, nll, logsumexp = rng.integers(0, VOCAB, TOKENS).astype(np.int32), np.zeros(TOKENS, np.float32), \
        np.zeros(TOKENS, np.float32)
    cos, sin = normal(S, 1, D), normal(S, 1, D)
    rope_in, rope_grad = normal(B, S, HEADS, D), normal(B, S, HEADS, D)  # 8 x 256 whatever the attention's seq_len
    shapes = small_parameter_shapes()
    params, moments, grads = ([normal(*s) for s in shapes] for _ in range(3))
    second = [np.abs(normal(*s)) for s in shapes]
    hyper = np.array([1e-3, 0.9, 0.95, 1e-8, 1.0, 0.5], np.float32)
    decay = np.full(len(shapes), 0.1, np.float32)
    like = np.zeros_like
    out = {
        "attention_forward": ("attention", [q, k, v, segments, o, lse], 2),
        "attention_backward": ("attention", [q, k, v, segments, o, lse, dout, like(q), like(k), like(v)], 3),
        "rms_norm_forward": ("layers", [x, weight, np.float32([1e-5]), like(x), inv_rms], 2),
        "rms_norm_backward": ("layers", [x, weight, inv_rms, normal(TOKENS, HIDDEN), like(x), like(weight)], 2),
        "swiglu_forward": ("layers", [gate, up, like(gate)], 1),
        "swiglu_backward": ("layers", [gate, up, normal(TOKENS, FFN), like(gate), like(gate)], 2),
        "rope_forward": ("layers", [rope_in, cos, sin, like(rope_in)], 1),
        "rope_backward": ("layers", [rope_grad, cos, sin, like(rope_in)], 1),
        "cross_entropy_forward": ("layers", [logits, targets, nll, logsumexp], 2),
        "cross_entropy_backward": ("layers", [logits, targets, logsumexp, np.ones(TOKENS, np.float32), like(logits)],
                                   1),
        "square_sum": ("optimizer", [grads[0], np.zeros(1, np.float32)], 1),
    }
    out = {name: (library, arrays, slice(len(arrays) - n, None)) for name, (library, arrays, n) in out.items()}
    n = len(shapes)  # AdamW writes the parameters and both moments in place
    out["adamw"] = ("optimizer", [hyper, decay, *params, *moments, *second, *grads, np.zeros(1, np.float32)],
                    slice(2, 2 + 3 * n))
    return out


def kernel_call(path: str, op: str, arrays: List[np.ndarray]) -> Callable[[], None]:
    """A call of mindlab_<op> from the library at `path` on `arrays` (MindSpore's AOT signature)."""
    function = getattr(ctypes.CDLL(path), f"mindlab_{op}")
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    dims = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])

    def call():
        if function(n, params, ndims, shapes, None, None, None) != 0:
            raise RuntimeError(f"mindlab_{op} in {path} returned an error: its inputs do not match its signature")
    call.keep = (arrays, params, ndims, dims, shapes)  # the pointers' owners live as long as the call
    return call


def time_calls(call: Callable[[], None], calls: int) -> List[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the builds compared (1 without --compare)")
    p.add_argument("--only", default="", help="comma-separated ops (default all)")
    p.add_argument("--compare", action="append", default=[], metavar="LIBRARY=PATH")
    p.add_argument("--seq-len", type=int, default=S, help="the attention's row length")
    args = p.parse_args()
    if any("=" not in item for item in args.compare):
        raise SystemExit(f"--compare takes LIBRARY=PATH (e.g. attention=/tmp/attention.so), got {args.compare}")
    other = dict(item.split("=", 1) for item in args.compare)
    ops = _inputs(np.random.default_rng(0), args.seq_len)
    wanted = [name for name in args.only.split(",") if name] or list(ops)
    unknown = sorted(set(wanted) - set(ops)) + sorted(set(other) - {lib for lib, _, _ in ops.values()})
    if unknown:
        raise SystemExit(f"unknown op or library {unknown}: ops are {sorted(ops)}")
    print(f"{'op':<24} {'build':<10} {'best ms':>8} {'median ms':>10}")
    for name in wanted:
        library, arrays, written = ops[name]
        path, why = kernels.library(library)
        if path is None:
            raise SystemExit(why)
        if name in FORWARD_OF:
            kernel_call(path, FORWARD_OF[name], ops[FORWARD_OF[name]][1])()
        builds = {"venv": path, **({"compare": other[library]} if library in other else {})}
        copies = {label: [a.copy() for a in arrays] for label in builds}  # in-place ops (adamw) start equal
        calls = {label: kernel_call(build, name, copies[label]) for label, build in builds.items()}
        times = {label: [] for label in builds}
        for _ in range(args.rounds if len(builds) > 1 else 1):
            for label, call in calls.items():
                times[label] += time_calls(call, args.calls)
        for label, t in times.items():
            print(f"{name:<24} {label:<10} {min(t):>8.2f} {statistics.median(t):>10.2f}")
        if len(builds) > 1:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(copies["venv"][written], copies["compare"][written]))
            print(f"{'':<24} largest output difference {diff:.3g}")


if __name__ == "__main__":
    main()
