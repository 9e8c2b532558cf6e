"""How tokens/s and peak RSS grow with sequence length and width: native vs MindFormers vs PyTorch, one run.

    scripts/venv.sh python -m benchmarks.scaling [--seq-lens 128,256,512,1024,2048] [--widths 256,384,512,768]
        [--steps 8] [--warmup 3] [--impls native,mindformers,torch_sdpa,torch_eager] [--peak-tflops X]
        [--peak-sizes 1024,2048,4096] [--png benchmarks/scaling.png] [hydra overrides of every run ...]

Each point is a benchmarks/speed_memory.py measurement (every implementation in its own process, same data,
loss and optimizer). Sequence sweep: model=small (H384, 8 layers, 6 heads, vocab 8192) at a fixed 2048 tokens
per step (micro-batch 2048 / seq_len). Width sweep: seq_len 256, 8 rows, 8 layers, vocab 8192, H in --widths
with H/64 heads and a SwiGLU width of 8/3 H rounded to 64 (small's 1024 at H384). Prints one table per sweep
(with the model's training FLOPs/token: 6N + the attention term, which grows with seq_len) and writes a PNG
of both sweeps.
"""
import argparse
import os
import sys
import tempfile

from benchmarks.measure import ROOT
from benchmarks.speed_memory import COMMON, IMPLS, check_args, measured_peak_flops, peak_line, run_shape
from benchmarks.results import recorded

TOKENS_PER_STEP = 2048


def seq_point(seq_len: int) -> list:
    return ["model=small", f"data.seq_len={seq_len}", f"trainer.micro_batch_size={TOKENS_PER_STEP // seq_len}"]


def width_point(hidden: int) -> list:
    return ["model=small", f"model.hidden_size={hidden}", f"model.num_heads={hidden // 64}",
            f"model.num_kv_heads={hidden // 64}", f"model.intermediate_size={round(8 * hidden / 3 / 64) * 64}",
            "data.seq_len=256", "trainer.micro_batch_size=8"]


def sweep(name: str, values: list, point, impls: list, steps: int, warmup: int, peak: float, workdir: str,
          extra: list) -> dict:
    """{value: {impl: result}} over `values` of one axis; `extra`: Hydra overrides of every run."""
    out = {}
    for value in values:
        overrides = [*point(value), *COMMON, f"trainer.max_steps={steps}", *extra]
        out[value] = run_shape(overrides, impls, warmup, peak, workdir, f"-{name}{value}")
    return out


def table(name: str, results: dict, impls: list, peak: float) -> str:
    """tokens/s and peak RSS per implementation; MFLOP/token is the model's (the same for all of them)."""
    lines = [f"{name:>11} {'MFLOP/tok':>9} " + " ".join(f"{impl + ' tok/s':>17} {'RSS GiB':>8}" for impl in impls)]
    for value, by_impl in results.items():
        ok = [r for r in by_impl.values() if "error" not in r]
        cells = [f"{ok[0]['mfu'] * peak / ok[0]['tokens_per_sec'] / 1e6 if ok else float('nan'):>9.0f}"]
        for impl in impls:
            r = by_impl[impl]
            cells.append(f"{'failed':>17} {'':>8}" if "error" in r else
                         f"{r['tokens_per_sec']:>17.0f} {r['peak_rss_gb']:>8.2f}")
        lines.append(f"{value:>11} " + " ".join(cells))
    return "\n".join(lines)


def plot(sweeps: dict, impls: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(sweeps), figsize=(5.5 * len(sweeps), 7), squeeze=False)
    for col, (axis, results) in enumerate(sweeps.items()):
        for row, (key, label) in enumerate((("tokens_per_sec", "tokens/s"), ("peak_rss_gb", "peak RSS (GiB)"))):
            ax = axes[row][col]
            for impl in impls:
                points = [(v, r[impl][key]) for v, r in results.items() if key in r[impl]]
                if points:
                    ax.plot(*zip(*points), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(axis)
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"fp32 training step on this CPU ({TOKENS_PER_STEP} tokens/step in the seq_len sweep)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="128,256,512,1024,2048")
    p.add_argument("--widths", default="256,384,512,768")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--peak-tflops", type=float, default=None, help="skip the GEMM measurement, use this peak")
    p.add_argument("--peak-sizes", default="1024,2048,4096", help="the n x n GEMMs the peak is measured on")
    p.add_argument("--png", default=os.path.join(ROOT, "benchmarks", "scaling.png"))
    args, extra = p.parse_known_args()
    check_args(p, args.impls, args.steps, args.warmup)
    impls = args.impls.split(",")
    peak = {"peak": args.peak_tflops * 1e12} if args.peak_tflops else measured_peak_flops(args.peak_sizes)
    print(peak_line(peak), flush=True)
    sweeps = {}
    with tempfile.TemporaryDirectory() as workdir:
        if args.seq_lens:
            sweeps["seq_len"] = sweep("seq_len", [int(v) for v in args.seq_lens.split(",")], seq_point, impls,
                                      args.steps, args.warmup, peak["peak"], workdir, extra)
        if args.widths:
            sweeps["hidden_size"] = sweep("hidden", [int(v) for v in args.widths.split(",")], width_point, impls,
                                          args.steps, args.warmup, peak["peak"], workdir, extra)
    if extra:
        print(f"\nevery run with {' '.join(extra)}")
    for axis, results in sweeps.items():
        print(f"\n{axis} sweep ({'2048 tokens/step, model=small' if axis == 'seq_len' else 'seq 256 x 8 rows'}; "
              f"tokens/s over steps {args.warmup + 1}-{args.steps}):")
        print(table(axis, results, impls, peak["peak"]))
    plot(sweeps, impls, args.png)
    print(f"\nwrote {os.path.relpath(args.png, ROOT)}")


if __name__ == "__main__":
    with recorded("benchmarks.scaling", "Scaling with sequence length and width: native, MindFormers, PyTorch"):
        sys.exit(main())
