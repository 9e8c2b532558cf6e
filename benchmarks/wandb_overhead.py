"""Cost of W&B logging per logged step (offline mode), next to the cost of a training step.

    scripts/venv.sh python -m benchmarks.wandb_overhead

Logs 500 metrics lines shaped like the loop's through trainer.wandb_logger.WandbLogger in a temp dir, and
times the same number of writes to metrics.jsonl for reference.
"""
import boot  # noqa: F401

import os
import tempfile
import time

from omegaconf import OmegaConf

from trainer.metrics import MetricsFile
from trainer.wandb_logger import WandbLogger
from benchmarks.results import recorded

LINES = 500


def line(step: int) -> dict:
    return {"step": step, "loss": 3.0 + 1.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_seen": step * 4096,
            "tokens_per_sec": 7000.0, "mfu": 0.4, "skipped_steps": 0, "peak_rss_gb": 1.2,
            "tokens_seen/code": step * 2048, "tokens_seen/books": step * 2048}


def time_sink(sink) -> float:
    start = time.perf_counter()
    for step in range(1, LINES + 1):
        sink.log(line(step))
    elapsed = time.perf_counter() - start
    sink.close()
    return elapsed / LINES


def main() -> None:
    cfg = OmegaConf.create({"logger": {"project": "bench", "entity": None, "group": None, "run_name": "bench",
                                       "tags": [], "job_type": "bench", "mode": "offline"}})
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        logger = WandbLogger(cfg, run_dir, "benchrun")
        init = time.perf_counter() - start
        per_line = time_sink(logger)
        jsonl = time_sink(MetricsFile(os.path.join(run_dir)))
    print(f"wandb offline: init {init:.2f} s once per run, {per_line * 1e3:.3f} ms per logged step "
          f"(metrics.jsonl: {jsonl * 1e3:.3f} ms); x{per_line / jsonl:.0f} the file write")


if __name__ == "__main__":
    with recorded("benchmarks.wandb_overhead", "The cost of W&B logging"):
        main()
