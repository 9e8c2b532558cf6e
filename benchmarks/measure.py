"""Shared by the benchmarks: train once in a subprocess and read what metrics.jsonl says about it."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_and_measure(name: str, overrides: list, workdir: str) -> dict:
    """Run train.py with `overrides` in <workdir>/<name>; throughput is averaged over the logging intervals
    after the first (which holds the graph compilation)."""
    run_dir = os.path.join(workdir, name)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=workdir, stdout=subprocess.DEVNULL)
    logs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in line]
    steady = logs[1:] or logs
    return {"tokens_per_sec": sum(m["tokens_per_sec"] for m in steady) / len(steady),
            "mfu": sum(m["mfu"] for m in steady) / len(steady),
            "peak_rss_gb": logs[-1]["peak_rss_gb"], "final_loss": logs[-1]["loss"]}
