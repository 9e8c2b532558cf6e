"""MindSpore's CPU kernels on the same data in different layouts: why the native model reduces 2-D views and
broadcasts columns with Tile (models/llama/model.py, trainer/step.py).

    python -m kernels.probes.mindspore_ops [--repeats 10]

Each row compiles one graph of 8 independent ops on 8 different inputs (an `ms.mutable` tuple, so nothing is
constant-folded: a plain tuple of tensors is a graph constant) and prints the mean time per op over the
repeated calls, the slow form and the fast form of the same result side by side.
"""
import argparse
import time

import boot  # noqa: F401  (MindSpore first)
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

OPS = 8
_sum, _sum_keep, _mean_keep, _tile = ops.ReduceSum(), ops.ReduceSum(keep_dims=True), ops.ReduceMean(keep_dims=True), ops.Tile()


def rows_2d(x):
    return x.reshape(-1, x.shape[-1])


def row_sums(x):
    return _sum_keep(x, -1)


def row_sums_2d(x):
    return _sum_keep(rows_2d(x), -1).reshape(x.shape[:-1] + (1,))


def row_means(x):
    return _mean_keep(x, -1)


def row_means_2d(x):
    return _mean_keep(rows_2d(x), -1).reshape(x.shape[:-1] + (1,))


def column_sums(x):
    return _sum(x, (0, 1))


def column_sums_2d(x):
    return _sum(rows_2d(x), 0)


def square_sum(x):
    return _sum(x * x)


def square_sum_by_columns(x):
    return _sum(_sum(x * x, 0))


def broadcast_column(x):
    return ops.broadcast_to(x, (x.shape[0], 384))


def tile_column(x):
    return _tile(x, (1, 384))


CASES = [  # (what, input shape, slow form, fast form)
    ("row sums of [8, 6, 256, 256]", (8, 6, 256, 256), row_sums, row_sums_2d),
    ("row sums of [8, 256, 384]", (8, 256, 384), row_sums, row_sums_2d),
    ("row means of [8, 256, 384]", (8, 256, 384), row_means, row_means_2d),
    ("column sums of [8, 256, 384]", (8, 256, 384), column_sums, column_sums_2d),
    ("sum of squares of [8192, 384]", (8192, 384), square_sum, square_sum_by_columns),
    ("[2048, 1] -> [2048, 384]", (2048, 1), broadcast_column, tile_column),
]


def time_per_op(fn, shape, repeats: int) -> float:
    class Graph(nn.Cell):
        def construct(self, xs):
            outs = ()
            for x in xs:
                outs = outs + (fn(x),)
            return outs

    rng = np.random.default_rng(0)
    xs = ms.mutable(tuple(Tensor(rng.normal(size=shape).astype(np.float32)) for _ in range(OPS)))
    graph = Graph()
    [out.asnumpy() for out in graph(xs)]  # compile
    start = time.perf_counter()
    for _ in range(repeats):
        [out.asnumpy() for out in graph(xs)]
    return (time.perf_counter() - start) / (repeats * OPS) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    print(f"{'what':32s} {'slow form':24s} {'ms':>6s}   {'fast form':24s} {'ms':>6s}")
    for what, shape, slow, fast in CASES:
        a, b = time_per_op(slow, shape, args.repeats), time_per_op(fast, shape, args.repeats)
        print(f"{what:32s} {slow.__name__:24s} {a:6.2f}   {fast.__name__:24s} {b:6.2f}", flush=True)


if __name__ == "__main__":
    main()
