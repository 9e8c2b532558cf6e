"""Context extension, end to end: loss by position and passkey accuracy for (a) a base model at its training
length, (b) zero-shot extension with each RoPE scaling, (c) after stage=long_context.

    python -m benchmarks.long_context                     # model=small, base at 256, zero-shot x8, extended x4, x8
    python -m benchmarks.long_context --model tiny --base-steps 400 --extend-steps 150 --work runs/lc

Steps (each a subprocess; needs ../shared/corpora for data=long_docs):
  1. train.py model=M model.max_position_embeddings=B data=long_docs data.seq_len=B (the base, B = --base-len)
  2. python -m evaluation on it with a window of B x --factor: rope none (extrapolation: max_position_embeddings raised,
     nothing scaled), linear, ntk, dynamic, yarn, llama3 with that factor; loss on rows of B and of the window,
     passkey at B, 2B, 4B, ... the window
  3. train.py stage=long_context from the base for each of --extend-factors (yarn x F, data.seq_len = B x F, the
     same --extend-tokens per step), evaluated the same way up to its window, and at B x --factor with the factor
     raised when its window is shorter (zero-shot past its window); and a control: the same steps, tokens per
     step and lr at length B without scaling, evaluated like the base
Every evaluation uses the same validation documents (data=long_docs, objective=clm stream packing, rows re-packed
at each length). Loss by position comes from rows of the full window: in a causal model the positions < n of a
long row see what a row of n tokens sees (dynamic NTK aside, whose table follows the row length, which is why
rows of B are scored too). Prints one table of mean NLL per position range, one of passkey accuracy (mean over
depths) per length, and the tokens/s and peak RSS of each training run at its length (metrics.jsonl: the mean
over the logging intervals after the first, which holds the compile).
"""
import argparse
import hashlib
import json
import math
import os
import subprocess
import sys

from omegaconf import OmegaConf
from benchmarks.results import recorded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")


def run(cmd, log):
    print("$", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def evaluate(ckpt, overrides, base_len, window, out, log, a):
    """{length: [bucket, ...]} (buckets of base_len target positions) for rows of base_len and of `window`, and
    {length: {depth: accuracy}} at base_len, 2 x base_len, ... window."""
    if not os.path.isfile(out):
        csv = ",".join(str(n) for n in doublings(base_len, window))
        run([sys.executable, "-m", "evaluation", ckpt, "tasks=[]", f"eval.batches={a.eval_batches}",
             f"eval.position_bucket={base_len}", f"eval.context_lengths=[{window}]", f"eval.passkey_lengths=[{csv}]",
             f"eval.passkey_trials={a.passkey_trials}", f"eval.passkey_depths=[{a.passkey_depths}]", "data=long_docs",
             f"data.seq_len={base_len}", "objective=clm", "trainer.micro_batch_size=2", *overrides, "--out", out], log)
    r = json.load(open(out))
    return {int(k): v["all"] for k, v in r["data_eval"]["context_lengths"].items()}, r.get("passkey", {})


def doublings(base_len, longest):
    """base_len, 2 x base_len, 4 x base_len, ... longest."""
    out = [base_len]
    while out[-1] < longest:
        out.append(min(out[-1] * 2, longest))
    return out


def ranges(base_len, longest):
    """Position ranges [0, B), [B, 2B), [2B, 4B), ... up to `longest`."""
    ends = doublings(base_len, longest)
    return list(zip([0] + ends[:-1], ends))


def range_loss(buckets, start, end):
    """Token-weighted mean NLL of the buckets inside [start, end); None past the row's length."""
    sel = [b for b in buckets if b["start"] >= start and b["end"] <= end and b["tokens"]]
    if not sel or sel[-1]["end"] < end:
        return None
    return sum(b["loss"] * b["tokens"] for b in sel) / sum(b["tokens"] for b in sel)


def latest(run_dir):
    ckpts = sorted(c for c in os.listdir(os.path.join(run_dir, "checkpoints")) if c.startswith("step_"))
    return os.path.join(run_dir, "checkpoints", ckpts[-1])


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "long_context"),
                   help="kept: the runs and evaluations of each setting in a directory of their own, reused by a "
                        "rerun with the same settings")
    p.add_argument("--model", default="small")
    p.add_argument("--base-len", type=int, default=256)
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--base-micro-batch", type=int, default=8)
    p.add_argument("--factor", type=int, default=8, help="zero-shot scaling factor (window B x factor)")
    p.add_argument("--extend-factors", type=int, nargs="+", default=[4, 8])
    p.add_argument("--extend-steps", type=int, default=150)
    p.add_argument("--extend-tokens", type=int, default=2048, help="tokens per step of the extensions and control")
    p.add_argument("--attention-chunk", type=int, default=0, help="model.attention_chunk for the extension (0: off)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches (of 2 rows) per source")
    p.add_argument("--passkey-trials", type=int, default=4, help="keys per length and depth")
    p.add_argument("--passkey-depths", default="0.1,0.5,0.9")
    return p.parse_args()


def settings_dir(a: argparse.Namespace) -> str:
    """<work>/<the settings' digest>: a rerun with other settings (another --base-len) never reuses a base trained
    with these, which its evaluations would refuse or, worse, score at the wrong length."""
    settings = json.dumps({k: v for k, v in sorted(vars(a).items()) if k != "work"})
    return os.path.join(a.work, hashlib.sha256(settings.encode()).hexdigest()[:12])


def main() -> None:
    a = arguments()
    a.work = settings_dir(a)
    os.makedirs(a.work, exist_ok=True)
    log = os.path.join(a.work, "log.txt")
    B = a.base_len
    common = [f"model={a.model}", f"model.max_position_embeddings={B}", "trainer.eval_every=0",
              "logger.progress_bar=false"]
    base_dir = os.path.join(a.work, "base")
    if not os.path.isdir(os.path.join(base_dir, "checkpoints")):
        run([sys.executable, "train.py", *common, "data=long_docs", f"data.seq_len={B}", "optim.lr=1e-3",
             "optim.min_lr=1e-4", f"optim.warmup_steps={min(30, a.base_steps // 10)}",
             f"trainer.micro_batch_size={a.base_micro_batch}",
             f"trainer.max_steps={a.base_steps}", f"hydra.run.dir={base_dir}"], log)
    base = latest(base_dir)
    longest = B * a.factor
    rows, passkeys = [], []  # (name, window, {length: buckets}), (name, {length: {depth: acc}})
    for method in METHODS:
        scaling = [f"model.max_position_embeddings={longest}"] if method == "none" else \
            [f"model.rope_scaling.type={method}", f"model.rope_scaling.factor={a.factor}"]
        name = "base, none (no scaling)" if method == "none" else f"base, {method} x{a.factor}"
        by_len, pk = evaluate(base, scaling, B, longest, os.path.join(a.work, f"eval-{method}.json"), log, a)
        rows.append((name, longest, by_len))
        passkeys.append((name, pk))
    runs = [("base", B, base_dir)]  # (name, trained length, run dir) for the speed table
    extended = []
    for f in a.extend_factors:
        ext_len = B * f
        ext_dir = os.path.join(a.work, f"extended-x{f}")
        if not os.path.isdir(os.path.join(ext_dir, "checkpoints")):
            chunk = [f"model.attention_chunk={a.attention_chunk}", "model.recompute=selective"] \
                if a.attention_chunk else []
            run([sys.executable, "train.py", "stage=long_context", f"stage.init_from={base}", *common,
                 f"trainer.micro_batch_size={max(a.extend_tokens // ext_len, 1)}", f"data.seq_len={ext_len}",
                 "model.rope_scaling.type=yarn", f"model.rope_scaling.factor={f}", *chunk,
                 f"trainer.max_steps={a.extend_steps}", f"hydra.run.dir={ext_dir}"], log)
        runs.append((f"stage=long_context yarn x{f}", ext_len, ext_dir))
        ext = latest(ext_dir)
        name = f"stage=long_context yarn x{f} ({a.extend_steps} steps at {ext_len})"
        by_len, pk = evaluate(ext, [], B, ext_len, os.path.join(a.work, f"eval-extended-x{f}.json"), log, a)
        extended += [(name, ext_len, by_len, pk)]
        if longest > ext_len:
            name = f"stage=long_context yarn x{f}, raised to x{a.factor} at eval"
            by_len, pk = evaluate(ext, [f"model.rope_scaling.factor={a.factor}"], B, longest,
                                  os.path.join(a.work, f"eval-extended-x{f}-raised.json"), log, a)
            extended += [(name, longest, by_len, pk)]
    # control: the same continued training (steps, tokens per step, lr) at the base length without scaling, so
    # what the extended model gains at short positions from more training is not credited to the extension
    ctl_dir = os.path.join(a.work, "continued-base-len")
    if not os.path.isdir(os.path.join(ctl_dir, "checkpoints")):
        run([sys.executable, "train.py", "stage=long_context", f"stage.init_from={base}", *common,
             f"trainer.micro_batch_size={a.extend_tokens // B}", f"data.seq_len={B}",
             "model.rope_scaling.type=none", "model.rope_scaling.factor=1", f"trainer.max_steps={a.extend_steps}",
             f"hydra.run.dir={ctl_dir}"], log)
    runs.append(("control (continued at the base length)", B, ctl_dir))
    name = f"control: same {a.extend_steps} steps at {B}, no scaling"
    by_len, pk = evaluate(latest(ctl_dir), [f"model.max_position_embeddings={longest}"], B, longest,
                          os.path.join(a.work, "eval-control.json"), log, a)
    rows.append((name, longest, by_len))
    passkeys.append((name, pk))
    rows += [(name, window, by_len) for name, window, by_len, _ in extended]
    passkeys += [(name, pk) for name, _, _, pk in extended]
    print_tables(a, rows, passkeys, runs)


def print_tables(a: argparse.Namespace, rows: list, passkeys: list, runs: list) -> None:
    """The three tables: loss by position (`rows`), passkey accuracy (`passkeys`), training cost (`runs`)."""
    B, longest = a.base_len, a.base_len * a.factor
    lengths = doublings(B, longest)
    spans = ranges(B, longest)
    fmt = lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
    print(f"\nmean NLL (nats/token) by target position, rows of the method's window; 'loss@{B}' is the mean over "
          f"rows of {B} tokens (model={a.model} pretrained at {B} for {a.base_steps} steps)\n")
    print(f"| model, rope | window | loss@{B} | " + " | ".join(f"pos {s}-{e}" for s, e in spans) + " |")
    print("|---|---:|---:|" + "---:|" * len(spans))
    for name, window, by_len in rows:
        short = range_loss(by_len[B], 0, B)
        print(f"| {name} | {window} | {fmt(short)} | " +
              " | ".join(fmt(range_loss(by_len[window], s, e)) for s, e in spans) + " |")
    print("\npasskey accuracy (10 candidate keys, chance 0.10; mean over depths, "
          f"{a.passkey_trials} trials per depth)\n")
    print("| model, rope | " + " | ".join(f"len {n}" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for name, pk in passkeys:
        cells = [f"{sum(pk[str(n)].values()) / len(pk[str(n)]):.2f}" if str(n) in pk else "" for n in lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")

    print(f"\ntraining cost at each trained length (model={a.model}, fp32, graph mode)\n")
    print("| run | seq_len | rows per step | tokens/s | peak RSS GB |")
    print("|---|---:|---:|---:|---:|")
    for name, length, run_dir in runs:
        logs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in line]
        steady = logs[1:] or logs
        tps = sum(m["tokens_per_sec"] for m in steady) / len(steady)
        rows_per_step = OmegaConf.load(os.path.join(run_dir, "config.yaml")).trainer.micro_batch_size
        print(f"| {name} | {length} | {rows_per_step} | {tps:.0f} | {logs[-1]['peak_rss_gb']:.2f} |")


if __name__ == "__main__":
    with recorded("benchmarks.long_context", "Context extension: loss by position and passkey accuracy"):
        main()
