"""Throughput and model-FLOPs utilisation, and metrics.jsonl: one JSON object per logged step or eval."""
import json
import os
import resource
import sys
import time

from models import family


class SpeedMonitor:
    """tokens/s over the last logging interval; MFU = flops_per_token x tokens/s / (peak x devices).

    flops_per_token is the model family's (6N + attention; models/<family>/accounting.py); the peak is the device's at the compute dtype
    (base/schema.py peak_tflops: `device.peak_tflops[precision.compute_dtype]`).
    """

    def __init__(self, model_cfg, seq_len: int, peak_tflops: float, num_devices: int):
        self.flops_per_token = family(model_cfg.family).flops_per_token(model_cfg, seq_len)
        self.peak_tflops, self.peak_flops = peak_tflops, peak_tflops * 1e12 * num_devices
        self.start, self.tokens = time.perf_counter(), 0
        self.over_peak = False  # said once: an MFU above 1 means the peak is wrong, not that the step is fast

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def measure(self) -> dict:
        now = time.perf_counter()
        tokens_per_sec = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        mfu = self.flops_per_token * tokens_per_sec / self.peak_flops
        if mfu > 1 and not self.over_peak:
            self.over_peak = True
            print(f"[speed] MFU {mfu:.0%} is above 100%: this machine computes more than device.peak_tflops "
                  f"({self.peak_tflops:g} TFLOP/s a device) says it can; set device.peak_tflops.<dtype> to its peak "
                  "(device=cpu: delete this CPU's entry in ~/.cache/mindlab/cpu_peak.json to measure it again)",
                  file=sys.stderr, flush=True)
        return {"tokens_per_sec": tokens_per_sec, "mfu": mfu}


def write_status(run_dir: str, status: str, **details) -> None:
    """<run_dir>/status.json: running | finished | preempted | failed (+ error), for reports over many runs."""
    tmp = os.path.join(run_dir, "status.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"status": status, "time": time.time(), **details}, f)
    os.replace(tmp, os.path.join(run_dir, "status.json"))


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsFile:
    """Appends each metrics dict as one JSON line to <run_dir>/metrics.jsonl, flushed at once.

    On resume from step N, lines of steps after N (written before the crash, about to be redone) are dropped,
    so the file reads as one uninterrupted run.
    """

    def __init__(self, run_dir: str, after_step: int = 0):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if after_step and os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= after_step]
            with open(self.path + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(self.path + ".tmp", self.path)
        self.file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
