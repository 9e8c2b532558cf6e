"""Speed and memory of one training step, side by side in one run: mindlab's native Llama, MindFormers'
LlamaForCausalLM (`model.impl=mindformers`) and a PyTorch 2.13 eager fp32 reference of the same shapes, data,
loss and optimizer (benchmarks/torch_reference.py; `torch_sdpa`: scaled_dot_product_attention, `torch_eager`:
plain matmul-softmax-matmul attention, the math of ours).

    scripts/venv.sh python -m benchmarks.speed_memory [--shapes small,medium] [--steps 20] [--warmup 3]
        [--impls native,mindformers,torch_sdpa,torch_eager] [--peak-tflops X | --peak-sizes 1024,2048,4096]
        [--rounds N] [hydra overrides ...]

Every implementation trains in its own process, one after the other (so peak RSS is its own), logging every
step. `native_warm` is native run a second time with `trainer.compile_cache=true`, loading the graphs its first
run compiled (a resume or rerun of the same config). Per implementation:
  tokens/s      steady state: total tokens / total time of the steps after the first --warmup (compile)
  median step   tokens/s of the median step after --warmup: deaf to a one-off step in the window, e.g.
                MindFormers' 5th step, which at medium grows its memory pool (peak RSS 8.89 -> 9.36 GiB) and
                took ~2.5 s more than its others
  first step s  wall clock from the process launch to its first metrics.jsonl line: imports, data (already
                prepared: the export step below leaves it in the cache), model build, compile, first update
  peak RSS GiB  the process's ru_maxrss at its last step
  MFU           training FLOPs/token (models/llama/accounting.py: 6N + attention) x tokens/s / measured peak;
                the peak is the best fp32 GEMM FLOP/s of MindSpore, PyTorch (2 threads) and numpy on this
                machine (benchmarks/cpu_matmul_peak.py), measured in its own process at the start
  final loss    the last step's loss (all implementations see the same batches; PyTorch starts from the
                native model's initial weights, MindFormers from its own initialization)
  loss curve    for each PyTorch run, the largest gap between its loss and native's at the same step, relative
                to native's (the goal's "same loss curve within fp32 noise": run with --steps 50)
The 1-minute load average is printed at each launch and exit: the box is shared, so ratios within one run
are what count. `--rounds N` runs the whole list N times, interleaved, and prints native's ratio to each other
implementation per round and their median (one implementation's tokens/s moved by 5-7% between runs minutes
apart on a 2-core box). Round r starts the list at its r-th implementation (native, mindformers, torch_sdpa;
then mindformers, torch_sdpa, native; ...), so no implementation always runs first, right after the peak
measurement or the previous round's last run. Hydra overrides apply to every run (and to the PyTorch export).

Shapes: `small` is model=small (H384, 8 layers, 6 heads, vocab 8192) at 8 x 256 tokens per step. `medium` is
H512, 8 layers, 8 heads, SwiGLU 1344 (8/3 H rounded to 64, as small's 1024), vocab 32000 at 4 x 512 tokens:
its 32000-piece tokenizer is trained on the default data on first use (cached afterwards).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.measure import ROOT, RunFailed, timed_run, train_command
from benchmarks.results import write_section

SHAPES = {
    "small": ["model=small", "data.seq_len=256", "trainer.micro_batch_size=8"],
    "medium": ["model=small", "model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=8",
               "model.intermediate_size=1344", "model.vocab_size=32000", "data.seq_len=512",
               "trainer.micro_batch_size=4"],
}
LR_WARMUP = 5  # optim.warmup_steps: a run needs more steps than that
COMMON = ["trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1", f"optim.warmup_steps={LR_WARMUP}",
          "logger.progress_bar=false", "trainer.resume=none"]
IMPLS = ("native", "native_warm", "mindformers", "torch_sdpa", "torch_eager")


def measured_peak_flops(sizes: str = "1024,2048,4096") -> dict:
    """benchmarks/cpu_matmul_peak.py's measured_peak() over the n x n GEMMs of `sizes`, in a process of its own."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.cpu_matmul_peak", "--json", "--sizes", sizes], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summarize(run: dict, warmup: int, flops_per_token: float, peak_flops: float) -> dict:
    """The figures of one timed run (benchmarks/measure.timed_run) whose metrics.jsonl logged every step."""
    logs = run["logs"]
    steady = logs[warmup:] or logs[-1:]
    step_s = [1 / m["tokens_per_sec"] for m in steady]  # seconds per token of each step (same tokens each)
    tokens_per_sec = len(step_s) / sum(step_s)  # total tokens / total time
    return {"tokens_per_sec": tokens_per_sec, "median_step_tokens_per_sec": 1 / statistics.median(step_s),
            "first_step_s": run["first_log_s"],
            "peak_rss_gb": logs[-1]["peak_rss_gb"], "mfu": flops_per_token * tokens_per_sec / peak_flops,
            "final_loss": logs[-1]["loss"], "losses": [m["loss"] for m in logs], "steps": len(logs),
            "wall_s": run["wall_s"], "load": run["load"]}


def loss_gap(native: list, other: list) -> tuple:
    """(largest |other - native| / native over the steps both logged, its step counted from 1)."""
    gaps = [abs(b - a) / abs(a) for a, b in zip(native, other)]
    step = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps[step], step + 1


def run_shape(overrides: list, impls, warmup: int, peak_flops: float, workdir: str, tag: str = "") -> dict:
    """{impl: summarize(...) or {"error": message}} for one shape; `overrides` include trainer.max_steps."""
    export_dir = os.path.join(workdir, f"export{tag}")
    subprocess.run([sys.executable, "-m", "benchmarks.torch_reference", "export", export_dir, *overrides],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(export_dir, "meta.json"), encoding="utf-8") as f:
        flops_per_token = json.load(f)["flops_per_token"]
    results = {}
    for impl in impls:
        run_dir = os.path.join(workdir, f"{impl}{tag}")
        fill = None  # a run before the measured one (native_warm: the one that fills the compile cache)
        if impl.startswith("torch_"):
            cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "torch_reference.py"), "train", export_dir,
                   impl[len("torch_"):], run_dir]
        elif impl == "native_warm":
            cached = [*overrides, "model.impl=native", "trainer.compile_cache=true",
                      f"trainer.compile_cache_dir={os.path.join(workdir, 'compile' + tag)}"]
            fill, cmd = train_command(cached, run_dir + "-cold"), train_command(cached, run_dir)
        else:
            cmd = train_command([*overrides, f"model.impl={impl}"], run_dir)
        try:
            filled = timed_run(fill, run_dir + "-cold", workdir) if fill else None
            results[impl] = summarize(timed_run(cmd, run_dir, workdir), warmup, flops_per_token, peak_flops)
            if filled:
                results[impl]["fill_first_step_s"] = filled["first_log_s"]
        except RunFailed as err:  # e.g. out of memory at a long sequence: the other rows still count
            killed = " (killed: out of memory?)" if err.returncode == -9 else ""
            results[impl] = {"error": f"exit {err.returncode}{killed}: {err.tail.strip().splitlines()[-1][:160]}"}
        shown = {k: v for k, v in results[impl].items() if k != "losses"}
        print(f"  {tag.strip('-') or 'run'} {impl}: {shown}", flush=True)
    return results


def table(results: dict) -> str:
    lines = [f"{'impl':<12} {'tokens/s':>9} {'median step':>12} {'first step s':>13} {'peak RSS GiB':>13} "
             f"{'MFU':>7} {'final loss':>11} {'load (launch/exit)':>19}"]
    for impl, r in results.items():
        if "error" in r:
            lines.append(f"{impl:<12} failed: {r['error']}")
            continue
        lines.append(f"{impl:<12} {r['tokens_per_sec']:>9.0f} {r['median_step_tokens_per_sec']:>12.0f} "
                     f"{r['first_step_s']:>13.1f} {r['peak_rss_gb']:>13.2f} "
                     f"{r['mfu']:>7.1%} {r['final_loss']:>11.4f} {r['load'][0]:>9.2f}/{r['load'][1]:.2f}")
    if "fill_first_step_s" in results.get("native_warm", {}):
        lines.append(f"native_warm: the first run, which wrote the compile cache, took "
                     f"{results['native_warm']['fill_first_step_s']:.1f} s to its first step")
    native = results.get("native", {})
    for other in (impl for impl in IMPLS if not impl.startswith("native")):
        r = results.get(other, {})
        if "tokens_per_sec" in native and "tokens_per_sec" in r:
            median = native["median_step_tokens_per_sec"] / r["median_step_tokens_per_sec"]
            lines.append(f"native / {other}: tokens/s x{native['tokens_per_sec'] / r['tokens_per_sec']:.2f} "
                         f"(median step x{median:.2f}), "
                         f"peak RSS x{native['peak_rss_gb'] / r['peak_rss_gb']:.2f}, "
                         f"first step x{native['first_step_s'] / r['first_step_s']:.2f}")
        if other.startswith("torch_") and "losses" in native and "losses" in r:  # same weights and batches
            gap, step = loss_gap(native["losses"], r["losses"])
            lines.append(f"native / {other}: loss curve within {gap:.1e} (relative) over {len(r['losses'])} steps,"
                         f" the largest gap at step {step}")
    return "\n".join(lines)


def round_ratios(shape: str, rounds: list) -> str:
    """native's tokens/s over each other implementation's, by the mean and by the median step, round by round
    (each round runs them back to back, so a drift of the box's load between rounds cancels in its ratio), and
    their median."""
    lines = []
    for other in (impl for impl in IMPLS if not impl.startswith("native")):
        pairs = [(r.get("native", {}), r.get(other, {})) for r in rounds]
        for key, label in (("tokens_per_sec", "tokens/s"), ("median_step_tokens_per_sec", "median step")):
            ratios = [native[key] / theirs[key] for native, theirs in pairs if key in native and key in theirs]
            if ratios:
                lines.append(f"{shape}: native / {other} {label} by round {', '.join(f'{x:.2f}' for x in ratios)};"
                             f" median x{statistics.median(ratios):.2f}")
    return "\n".join(lines)


def check_args(parser, impls: str, steps: int, warmup: int, shapes: str = "small") -> None:
    """parser.error (one line, exit 2) on an unknown implementation or shape, or too few steps."""
    for name, given, known in (("--shapes", shapes, SHAPES), ("--impls", impls, IMPLS)):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if steps <= max(warmup, LR_WARMUP):
        parser.error(f"--steps {steps} must exceed --warmup {warmup} and the lr warmup ({LR_WARMUP} steps)")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="small", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s (compile)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--peak-tflops", type=float, default=None, help="skip the GEMM measurement, use this peak")
    p.add_argument("--peak-sizes", default="1024,2048,4096", help="the n x n GEMMs the peak is measured on")
    p.add_argument("--rounds", type=int, default=1, help="run the implementations this many times, interleaved")
    p.add_argument("--no-results", action="store_true", help="do not write the tables into benchmarks/RESULTS.md")
    args, overrides = p.parse_known_args(argv)
    check_args(p, args.impls, args.steps, args.warmup, shapes=args.shapes)
    return args, overrides


def peak_line(peak: dict) -> str:
    if "by" not in peak:
        return f"peak: {peak['peak'] / 1e12:.3f} TFLOP/s (given)"
    return (f"measured peak (best n x n fp32 GEMM, n in {'/'.join(map(str, peak['sizes']))}): "
            f"{peak['peak'] / 1e12:.3f} TFLOP/s by "
            f"{peak['by']} (mindspore {peak['mindspore'] / 1e12:.3f}, pytorch 2 threads {peak['pytorch'] / 1e12:.3f}, "
            f"numpy {peak['numpy'] / 1e12:.3f})")


def main(argv=None) -> None:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    peak = {"peak": args.peak_tflops * 1e12} if args.peak_tflops else measured_peak_flops(args.peak_sizes)
    print(peak_line(peak), flush=True)
    report = [peak_line(peak)]
    with tempfile.TemporaryDirectory() as workdir:
        for shape in args.shapes.split(","):
            run_overrides = [*SHAPES[shape], *COMMON, f"trainer.max_steps={args.steps}", *overrides]
            rounds = []
            impls = args.impls.split(",")
            for r in range(args.rounds):
                tag = f"-{shape}" + (f"-round{r + 1}" if args.rounds > 1 else "")
                first = r % len(impls)
                results = run_shape(run_overrides, impls[first:] + impls[:first], args.warmup, peak["peak"], workdir,
                                    tag)
                rounds.append({impl: results[impl] for impl in impls})
                head = f"{tag[1:]}: {' '.join(run_overrides)} (tokens/s over steps {args.warmup + 1}-{args.steps})"
                print(f"\n{head}")
                print(table(rounds[-1]), flush=True)
                report += [head, "```\n" + table(rounds[-1]) + "\n```"]
            if args.rounds > 1:
                print(round_ratios(shape, rounds), flush=True)
                report.append("```\n" + round_ratios(shape, rounds) + "\n```")
    if not args.no_results:
        write_section("benchmarks.speed_memory", "Speed and memory of one training step: native, MindFormers, PyTorch",
                      "\n\n".join(report))


if __name__ == "__main__":
    main()
