"""Throughput and model-FLOPs utilisation, and metrics.jsonl: one JSON object per logged step or eval."""
import json
import os
import resource
import time

from models.accounting import flops_per_token


class SpeedMonitor:
    """tokens/s over the last logging interval; MFU = flops_per_token x tokens/s / (peak x devices).

    flops_per_token is 6N + 12 L H D S (models/accounting.py); the peak comes from `device.peak_tflops`.
    """

    def __init__(self, model_cfg, seq_len: int, peak_tflops: float, num_devices: int):
        self.flops_per_token = flops_per_token(model_cfg, seq_len)
        self.peak_flops = peak_tflops * 1e12 * num_devices
        self.start, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def measure(self) -> dict:
        now = time.perf_counter()
        tokens_per_sec = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        return {"tokens_per_sec": tokens_per_sec, "mfu": self.flops_per_token * tokens_per_sec / self.peak_flops}


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsFile:
    """Appends each metrics dict as one JSON line to <run_dir>/metrics.jsonl, flushed at once."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
