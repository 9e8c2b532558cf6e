"""Every benchmark the docs name, one after another, each in its own process and writing its own section of
benchmarks/RESULTS.md: the one command that regenerates the whole file.

    scripts/venv.sh python -m benchmarks                          # every section, as the docs run them (hours)
    scripts/venv.sh python -m benchmarks generation bert_mlm      # only these
    scripts/venv.sh python -m benchmarks --smallest --results R.md --workdir W   # each at its smallest setting
    scripts/venv.sh python -m benchmarks --list                   # the benchmarks and their two settings

The checkpoints some of them start from are trained first, in --workdir (kept, so a second run reuses them): a
tiny pretrain (`make train`) and a tiny SFT from it on data=instructions, after the instruction and preference
sets (builders/). `--smallest` runs each benchmark with the least of everything that still runs every part of it
(a few steps, the smallest model and shapes), and makes its checkpoints as small: it checks that the benchmarks
run, not what they measure, so its sections go to `--results` (and its data to <workdir>/data), never to the
repository's RESULTS.md or the data cache. device_check needs an accelerator: it runs where there is one (`make
device-check`) and is left out here.
"""
import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Benchmark:
    """`python -m benchmarks.<name> <args>` as the docs type it (`args`) and at its smallest setting (`smallest`).
    {tiny}, {sft} stand for the checkpoints made first, {work} for a directory of its own."""
    args: Tuple[str, ...]
    smallest: Tuple[str, ...]


TINY_RUN = ("trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=1",
            "optim.warmup_steps=1", "logger.progress_bar=false")
BENCHMARKS: Dict[str, Benchmark] = {
    "speed_memory": Benchmark(("--shapes", "small", "--steps", "20"),
                              ("--shapes", "small", "--steps", "6", "--warmup", "1", "--peak-sizes", "256",
                               "--impls", "native,native_warm,mindformers,torch_sdpa,torch_eager",
                               "model.num_layers=1", "data.seq_len=32", "trainer.micro_batch_size=1")),
    "scaling": Benchmark((), ("--seq-lens", "32", "--widths", "128", "--steps", "6", "--warmup", "1",
                              "--impls", "native,torch_sdpa", "--peak-sizes", "256", "--png", "{work}/scaling.png",
                              "model.num_layers=1", "trainer.micro_batch_size=1")),
    "cpu_matmul_peak": Benchmark((), ("--sizes", "256")),
    "memory_timeline": Benchmark(("stage=tiny_pretrain",), ("stage=tiny_pretrain", "steps=1", "data.seq_len=32",
                                                            "trainer.micro_batch_size=1")),
    "generation": Benchmark((), ("--model", "tiny", "--prompt-len", "4", "--new", "2")),
    "attention_memory": Benchmark((), ("--model", "tiny", "--lengths", "128", "--chunk", "64", "--steps", "2")),
    "optimizers": Benchmark((), ("model=tiny", "data.seq_len=32", "trainer.micro_batch_size=1",
                                 "trainer.max_steps=2", "trainer.log_every=1", "optim.warmup_steps=1")),
    "dry_run_table": Benchmark((), ("--devices", "h100", "--models", "7b", "--lengths", "4k", "--nodes", "1")),
    "published_runs": Benchmark((), ()),
    "prepare_scale": Benchmark((), ("--sizes", "0.002", "--old-sizes", "--check-size", "0.002",
                                    "--work", "{work}")),
    "bert_mlm": Benchmark((), ("trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=1",
                               "trainer.log_every=1", "data.seq_len=32", "trainer.micro_batch_size=2")),
    "sft_lora": Benchmark(("--pretrain-steps", "300", "--steps", "150"),
                          ("--base", "{tiny}", "--steps", "2", "model=tiny", "data.seq_len=64", "objective.truncate=true",
                           "optim.warmup_steps=1",
                           "trainer.micro_batch_size=1", "trainer.eval_batches=1", "trainer.log_every=1")),
    "long_context": Benchmark(("--model", "tiny", "--base-steps", "400", "--passkey-trials", "3", "--work", "{work}"),
                              ("--model", "tiny", "--base-len", "64", "--base-steps", "2", "--base-micro-batch", "1",
                               "--factor", "2", "--extend-factors", "2", "--extend-steps", "2",
                               "--extend-tokens", "128", "--eval-batches", "1", "--passkey-trials", "1",
                               "--passkey-depths", "0.5", "--work", "{work}")),
    "alignment": Benchmark(("--base", "{tiny}", "--model", "tiny", "--workdir", "{work}"),
                           ("--base", "{tiny}", "--model", "tiny", "--sft-steps", "2", "--steps", "2",
                            "--ppo-steps", "4", "--rule-items", "2", "--workdir", "{work}", "trainer.eval_batches=1")),
    "dpo_reference": Benchmark(("--init", "{sft}", "--steps", "150", "--modes", "precomputed,copy"),
                               ("--init", "{sft}", "--steps", "2", "--train-pairs", "32", "--val-pairs", "8",
                                "--modes", "precomputed,copy", "--workdir", "{work}", "trainer.log_every=1",
                                "trainer.eval_batches=1")),
    "moe_dense": Benchmark((), ("trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=1",
                                "trainer.log_every=1", "trainer.micro_batch_size=1", "data.seq_len=32",
                                "optim.warmup_steps=1")),
    "sharded_build": Benchmark((), ("--model", "tiny", "--parallel", "tp8pp2")),
    "chat_zh": Benchmark((), ("--max-items", "2")),
    "recipe_chain": Benchmark((), ("--workdir", "{work}", *(f"recipe.stages.{s}.trainer.{k}={v}"
                                                            for s in ("pretrain", "sft", "dpo")
                                                            for k, v in (("max_steps", 2), ("eval_every", 2),
                                                                         ("save_every", 2), ("eval_batches", 1))),
                                   "recipe.stages.evaluate.eval.batches=1", "recipe.stages.evaluate.eval.max_items=2")),
}
# the checkpoints the benchmarks start from: (train.py overrides as the full run makes it, as --smallest does)
CHECKPOINTS = {
    "tiny": (("stage=tiny_pretrain",), ("stage=tiny_pretrain", *TINY_RUN)),
    "sft": (("stage=sft", "model=tiny", "data=instructions", "stage.init_from={tiny}", "trainer.max_steps=300",
             "trainer.micro_batch_size=8", "logger.progress_bar=false"),
            ("stage=sft", "model=tiny", "data=instructions", "stage.init_from={tiny}", "data.seq_len=64",
             "objective.truncate=true", *TINY_RUN)),
}
NEEDS = {"sft": ("tiny",)}  # a checkpoint made from another


def run(cmd: list, env: dict) -> float:
    """Run `cmd` in the repository root (its output shown); its wall seconds. A failure ends the whole run."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code != 0:
        raise SystemExit(f"benchmarks: `{' '.join(cmd)}` exited with {code}")
    return time.perf_counter() - start


def checkpoint(name: str, smallest: bool, workdir: str, env: dict, made: dict) -> str:
    """The last checkpoint of CHECKPOINTS[name], trained in <workdir>/<name> unless it already holds it."""
    if name in made:
        return made[name]
    for need in NEEDS.get(name, ()):
        checkpoint(need, smallest, workdir, env, made)
    full, small = CHECKPOINTS[name]
    overrides = [o.format(**made) for o in (small if smallest else full)]
    run_dir = os.path.join(workdir, name)
    ckpts = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpts) or not any(c.startswith("step_") for c in os.listdir(ckpts)):
        run([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"], env)
    made[name] = os.path.join(ckpts, max(c for c in os.listdir(ckpts) if c.startswith("step_")))
    return made[name]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help=f"of {', '.join(BENCHMARKS)} (default: all)")
    p.add_argument("--smallest", action="store_true", help="each at its smallest setting: does it run")
    p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "benchmarks"),
                   help="the checkpoints and each benchmark's own directory (kept)")
    p.add_argument("--results", help="the RESULTS.md to write (default: benchmarks/RESULTS.md; --smallest needs one)")
    p.add_argument("--list", action="store_true", help="print the benchmarks and their settings")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if args.list:
        for name, b in BENCHMARKS.items():
            print(f"{name}: {' '.join(b.args) or '(no arguments)'}\n  smallest: {' '.join(b.smallest) or '(none)'}")
        return
    if args.smallest and not args.results:
        p.error("--smallest measures nothing worth keeping: give --results (a file other than benchmarks/RESULTS.md)")
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    env = dict(os.environ)
    if args.results:
        env["MINDLAB_RESULTS"] = os.path.abspath(args.results)
    if args.smallest:
        env["MINDLAB_DATA_DIR"] = os.path.join(workdir, "data")
    names = args.names or list(BENCHMARKS)
    settings = {n: (BENCHMARKS[n].smallest if args.smallest else BENCHMARKS[n].args) for n in names}
    if any("{sft}" in a or name in ("alignment", "dpo_reference")
           for name, s in settings.items() for a in s):  # the instruction and preference sets, as the docs make them
        for builder in ("builders.instructions", "builders.preferences"):
            run([sys.executable, "-m", builder], env)
    made: Dict[str, str] = {}
    seconds = {}
    for name in names:
        needed = {c: checkpoint(c, args.smallest, workdir, env, made) for c in CHECKPOINTS
                  if any("{" + c + "}" in a for a in settings[name])}
        own = os.path.join(workdir, name)
        os.makedirs(own, exist_ok=True)
        seconds[name] = run([sys.executable, "-m", f"benchmarks.{name}",
                             *(a.format(work=own, **needed) for a in settings[name])], env)
    print("\n".join(f"benchmarks.{n}: {s:.0f} s" for n, s in seconds.items()))


if __name__ == "__main__":
    main()
