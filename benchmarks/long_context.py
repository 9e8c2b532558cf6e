"""Context extension, end to end: loss by position and passkey accuracy for (a) a base model at its training
length, (b) zero-shot extension with each RoPE scaling, (c) after stage=long_context.

    python -m benchmarks.long_context                     # model=small, base at 256, extended x4 and x8
    python -m benchmarks.long_context --base-steps 300 --extend-steps 200 --factors 4 8 --work runs/lc

Steps (each a subprocess; needs ../shared/corpora for data=long_docs):
  1. train.py model=small model.max_position_embeddings=256 data=long_docs data.seq_len=256 (the base)
  2. evaluate.py on it at lengths 256 and 256 x factor: rope none (extrapolation: max_position_embeddings
     raised, nothing scaled), linear, ntk, dynamic, yarn, llama3 at each factor
  3. train.py stage=long_context from the base (yarn, largest factor, data.seq_len = 256 x factor), evaluated
     the same way
Prints one table of mean NLL per position bucket (rows: model and method, columns: buckets of the longest
length) and one of passkey accuracy. Loss buckets past 256 are what extension is about.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_LEN = 256
METHODS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")


def run(cmd, log):
    print("$", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def evaluate(ckpt, overrides, length, out, log, passkey_trials):
    run([sys.executable, "-m", "evaluate", ckpt, "tasks=[]", "eval.batches=4", f"eval.position_bucket={length // 8}",
         f"eval.context_lengths=[{BASE_LEN},{length}]", f"eval.passkey_lengths=[{BASE_LEN},{length}]",
         f"eval.passkey_trials={passkey_trials}", "data=long_docs", f"data.seq_len={BASE_LEN}", *overrides,
         "--out", out], log)
    r = json.load(open(out))
    buckets = r["data_eval"]["context_lengths"][str(length)]
    return buckets.get("all"), r.get("passkey", {})


def latest(run_dir):
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    return os.path.join(run_dir, "checkpoints", [c for c in ckpts if c.startswith("step_")][-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "long_context"))
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--extend-steps", type=int, default=200)
    p.add_argument("--factors", type=int, nargs="+", default=[4, 8])
    p.add_argument("--passkey-trials", type=int, default=10)
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    log = os.path.join(a.work, "log.txt")
    common = ["model=small", f"model.max_position_embeddings={BASE_LEN}", "trainer.micro_batch_size=4",
              "trainer.eval_every=0"]
    base_dir = os.path.join(a.work, "base")
    if not os.path.isdir(os.path.join(base_dir, "checkpoints")):
        run([sys.executable, "train.py", *common, "data=long_docs", f"data.seq_len={BASE_LEN}", "optim.lr=1e-3",
             "optim.min_lr=1e-4", "optim.warmup_steps=30", f"trainer.max_steps={a.base_steps}",
             f"hydra.run.dir={base_dir}"], log)
    base = latest(base_dir)
    rows, passkeys = [], []
    longest = BASE_LEN * max(a.factors)
    for factor in a.factors:
        length = BASE_LEN * factor
        for method in METHODS:
            scaling = [f"model.max_position_embeddings={length}"] if method == "none" else \
                [f"model.rope_scaling.type={method}", f"model.rope_scaling.factor={factor}"]
            by_pos, pk = evaluate(base, scaling, length, os.path.join(a.work, f"eval-{method}-x{factor}.json"), log,
                                  a.passkey_trials)
            rows.append((f"base, {method} x{factor}", length, by_pos))
            passkeys.append((f"base, {method} x{factor}", pk))
    ext_dir = os.path.join(a.work, f"extended-x{max(a.factors)}")
    if not os.path.isdir(os.path.join(ext_dir, "checkpoints")):
        run([sys.executable, "train.py", "stage=long_context", f"stage.init_from={base}", *common,
             "trainer.micro_batch_size=1", f"data.seq_len={longest}", "model.rope_scaling.type=yarn",
             f"model.rope_scaling.factor={max(a.factors)}", f"model.attention_chunk={BASE_LEN}",
             "model.recompute=selective", f"trainer.max_steps={a.extend_steps}", f"hydra.run.dir={ext_dir}"], log)
    by_pos, pk = evaluate(latest(ext_dir), [], longest, os.path.join(a.work, "eval-extended.json"), log,
                          a.passkey_trials)
    rows.append((f"stage=long_context yarn x{max(a.factors)} ({a.extend_steps} steps)", longest, by_pos))
    passkeys.append((f"stage=long_context yarn x{max(a.factors)}", pk))

    print(f"\nmean NLL by target position (model=small pretrained at {BASE_LEN} for {a.base_steps} steps)\n")
    for length in sorted({r[1] for r in rows}):
        sel = [r for r in rows if r[1] == length]
        heads = [f"{b['start']}-{b['end']}" for b in sel[0][2]]
        print(f"| length {length} | " + " | ".join(heads) + " |\n|---|" + "---:|" * len(heads))
        for name, _, by_pos in sel:
            print(f"| {name} | " + " | ".join(f"{b['loss']:.3f}" for b in by_pos) + " |")
        print()
    print("passkey accuracy (10 candidates, chance 0.10), mean over depths\n")
    print("| model | " + " | ".join(f"len {k}" for k in passkeys[-1][1]) + " |")
    for name, pk in passkeys:
        print(f"| {name} | " + " | ".join(f"{sum(v.values()) / len(v):.2f}" for v in pk.values()) + " |")


if __name__ == "__main__":
    main()
