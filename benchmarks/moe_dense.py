"""A tiny mixture of experts against the dense model of the same active parameters, same data, tokens and steps, on
CPU: held-out bits per byte, tokens/s and the experts' load over training. The held-out bits per byte and loss are
the runs' val_bpb and val_loss: the LM cross-entropy alone, the MoE's router losses (training's only) left out.

    scripts/venv.sh python -m benchmarks.moe_dense [trainer.max_steps=60] ...

model=tiny (SwiGLU 352 wide) against model=moe_tiny (8 experts 176 wide, top 2: a token runs 352 wide, plus the
router), both from stage=tiny_pretrain; the MoE dropless (every expert holds room for every token: 4x the dense
feed-forward's rows computed) and with capacity factor 1.25 (2.5x, the overflow dropped). Each run is train.py in
its own process; tokens/s is averaged after the first logging interval (the compilation). Extra arguments are
Hydra overrides for all runs.
"""
import json
import os
import sys
import tempfile

from benchmarks.measure import train_and_measure
from benchmarks.results import recorded

RUNS = {"dense (model=tiny)": ["model=tiny"],
        "moe dropless (model=moe_tiny)": ["model=moe_tiny"],
        "moe capacity 1.25": ["model=moe_tiny", "model.capacity_factor=1.25"]}
DEFAULTS = ["stage=tiny_pretrain", "trainer.max_steps=60", "trainer.micro_batch_size=8", "trainer.log_every=10",
            "trainer.eval_every=60", "logger.progress_bar=false"]


def main() -> None:
    overrides = sys.argv[1:]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, keys in RUNS.items():
            run = f"run{len(rows)}"
            result = train_and_measure(run, [*DEFAULTS, *keys, *overrides], workdir)
            lines = [json.loads(line) for line in open(os.path.join(workdir, run, "metrics.jsonl"), encoding="utf-8")]
            evals = [m for m in lines if "val_bpb" in m]
            steps = [m for m in lines if "loss" in m and "val_loss" not in m]
            load = [f"{m['expert_load_max']:.2f}" for m in steps if "expert_load_max" in m]
            dropped = [m["dropped_share"] for m in steps if "dropped_share" in m]
            rows.append((name, evals[-1]["val_bpb"], evals[-1]["val_loss"], result["tokens_per_sec"],
                         " ".join(load) or "-", f"{sum(dropped) / len(dropped):.1%}" if dropped else "-"))
    print(f"overrides: {' '.join(DEFAULTS + overrides)}\n")
    print("| run | held-out bpb | val loss | tokens/s | busiest expert / mean, every 10 steps | dropped |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for name, bpb, loss, speed, load, dropped in rows:
        print(f"| {name} | {bpb:.4f} | {loss:.4f} | {speed:.0f} | {load} | {dropped} |")


if __name__ == "__main__":
    with recorded("benchmarks.moe_dense", "Mixture of experts against dense, same active parameters (CPU)"):
        main()
