"""Data parallel on this machine: `parallel=dp2` (2 msrun workers, mccl) vs one process, same global batch.

    scripts/venv.sh python -m benchmarks.data_parallel_speed [model=tiny] [trainer.max_steps=60] ...

Both runs see 8 sequences per step (one process: micro-batch 8; dp2: 4 per replica) of the same data with
the same schedule, so their losses match (tests/test_data_parallel.py checks it to 1e-5) and only the
speed differs. On 2 shared CPU cores two workers compete for the cores the single process uses alone.
"""
import sys
import tempfile

from benchmarks.measure import train_and_measure
from benchmarks.results import recorded

DEFAULTS = ["model=tiny", "data.seq_len=256", "trainer.max_steps=60", "trainer.log_every=10",
            "trainer.eval_every=0", "trainer.eval_batches=1", "optim.warmup_steps=5", "logger.progress_bar=false"]
RUNS = {"single": ["trainer.micro_batch_size=8"], "dp2": ["parallel=dp2", "trainer.micro_batch_size=4"]}


def main() -> None:
    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory() as workdir:
        results = {name: train_and_measure(name, [*DEFAULTS, *extra, *overrides], workdir)
                   for name, extra in RUNS.items()}
    print(f"overrides: {' '.join(DEFAULTS + overrides)}")
    print(f"{'run':<8} {'tokens/s':>10} {'peak RSS GiB (rank 0)':>22} {'final loss':>11}")
    for name, r in results.items():
        print(f"{name:<8} {r['tokens_per_sec']:>10.0f} {r['peak_rss_gb']:>22.2f} {r['final_loss']:>11.4f}")
    print(f"dp2 / single: tokens/s x{results['dp2']['tokens_per_sec'] / results['single']['tokens_per_sec']:.2f}")


if __name__ == "__main__":
    with recorded("benchmarks.data_parallel_speed", "Data parallel (dp2 under msrun) against one process"):
        main()
