"""Tokens/s, peak RSS and the loss reached for each optimizer preset, same model, data and steps.

    scripts/venv.sh python -m benchmarks.optimizers [model=small] [trainer.max_steps=30] ...

Each preset trains in its own process (train.py, as a user runs it); throughput is averaged after the
first logging interval (which holds the graph compilation). Extra arguments are Hydra overrides for all.
"""
import sys
import tempfile

from benchmarks.measure import train_and_measure
from benchmarks.results import recorded

PRESETS = ("adamw", "adamw_bert", "came")
DEFAULTS = ["model=small", "trainer.max_steps=30", "trainer.log_every=10", "trainer.eval_every=0",
            "trainer.eval_batches=1", "optim.warmup_steps=5", "logger.progress_bar=false"]


def main() -> None:
    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory() as workdir:
        results = {name: train_and_measure(name, [*DEFAULTS, f"optim={name}", *overrides], workdir) for name in PRESETS}
    print(f"overrides: {' '.join(DEFAULTS + overrides)}")
    print(f"{'optim':<12} {'tokens/s':>10} {'MFU':>7} {'peak RSS GiB':>13} {'final loss':>11}")
    for name, r in results.items():
        print(f"{name:<12} {r['tokens_per_sec']:>10.0f} {r['mfu']:>7.2%} {r['peak_rss_gb']:>13.2f} "
              f"{r['final_loss']:>11.4f}")


if __name__ == "__main__":
    with recorded("benchmarks.optimizers", "Optimizer presets: tokens/s, peak RSS and the loss reached"):
        main()
