"""Native mindlab Llama vs MindFormers' LlamaForCausalLM: tokens/s and peak RSS, side by side in one run.

    scripts/venv.sh python -m benchmarks.native_vs_mindformers [model=small] [trainer.max_steps=40] ...

Each implementation trains in its own process (so peak RSS is its own) on the same data, batch and
schedule. Throughput is taken after the first logging interval, which holds the graph compilation.
Extra arguments are Hydra overrides passed to both runs.
"""
import sys
import tempfile

from benchmarks.measure import train_and_measure

DEFAULTS = ["model=small", "trainer.max_steps=40", "trainer.log_every=10", "trainer.eval_every=0",
            "trainer.eval_batches=1", "optim.warmup_steps=5", "logger.progress_bar=false"]


def main() -> None:
    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory() as workdir:
        results = {impl: train_and_measure(impl, [*DEFAULTS, *overrides, f"model.impl={impl}"], workdir)
                   for impl in ("native", "mindformers")}
    print(f"overrides: {' '.join(DEFAULTS + overrides)}")
    print(f"{'impl':<12} {'tokens/s':>10} {'MFU':>7} {'peak RSS GiB':>13} {'final loss':>11}")
    for impl, r in results.items():
        print(f"{impl:<12} {r['tokens_per_sec']:>10.0f} {r['mfu']:>7.2%} {r['peak_rss_gb']:>13.2f} "
              f"{r['final_loss']:>11.4f}")
    n, m = results["native"], results["mindformers"]
    print(f"native / mindformers: tokens/s x{n['tokens_per_sec'] / m['tokens_per_sec']:.2f}, "
          f"peak RSS x{n['peak_rss_gb'] / m['peak_rss_gb']:.2f}")


if __name__ == "__main__":
    main()
