"""Shared by the benchmarks: train once in a subprocess and read what metrics.jsonl says about it."""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_and_measure(name: str, overrides: list, workdir: str) -> dict:
    """Run train.py with `overrides` in <workdir>/<name>; throughput is averaged over the logging intervals
    after the first (which holds the graph compilation)."""
    run_dir = os.path.join(workdir, name)
    timed_run(train_command(overrides, run_dir), run_dir, workdir)
    return summarize(run_dir)


def summarize(run_dir: str) -> dict:
    """train_and_measure's numbers of a finished run, from its metrics.jsonl."""
    logs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")
            if '"loss"' in line]
    steady = logs[1:] or logs
    return {"tokens_per_sec": sum(m["tokens_per_sec"] for m in steady) / len(steady),
            "mfu": sum(m["mfu"] for m in steady) / len(steady),
            "peak_rss_gb": logs[-1]["peak_rss_gb"], "final_loss": logs[-1]["loss"]}


def time_shares(logged: list) -> str:
    """Where a PPO run's step time went (its metrics.jsonl lines' time/<part>, seconds per step over each logging
    interval, weighted by the interval's steps), one line: each part's seconds per step and share."""
    parts = ("rollout", "reward", "reference", "update")
    timed = [m for m in logged if "time/step" in m]
    if not timed:
        return "no time/ numbers in the run's metrics (logged by objectives with timings: PPO)"
    spans = [m["step"] - (prev["step"] if prev else 0) for prev, m in zip([None] + timed[:-1], timed)]
    total = {p: sum(m[f"time/{p}"] * n for m, n in zip(timed, spans)) for p in (*parts, "step")}
    steps = sum(spans)
    shares = ", ".join(f"{p} {total[p] / steps:.3f} s ({total[p] / total['step']:.0%})" for p in parts)
    return f"PPO's time per step over {steps} steps: {shares}; step {total['step'] / steps:.3f} s"


def train_command(overrides: list, run_dir: str) -> list:
    return [sys.executable, os.path.join(ROOT, "train.py"), *overrides, f"hydra.run.dir={run_dir}"]


class RunFailed(RuntimeError):
    """A benchmarked process exited with `returncode` (-9: killed, on Linux usually the OOM killer)."""

    def __init__(self, cmd: list, returncode: int, tail: str):
        super().__init__(f"{' '.join(cmd)} exited with {returncode}:\n{tail}")
        self.returncode, self.tail = returncode, tail


def timed_run(cmd: list, run_dir: str, workdir: str, poll_s: float = 0.05) -> dict:
    """Run `cmd` (which writes <run_dir>/metrics.jsonl) and watch that file: {"logs": its loss lines,
    "first_log_s": seconds from the launch to its first loss line (with log_every=1: the process start,
    imports, data, model build, graph compile and the first optimizer step), "wall_s", "load": the 1-minute
    load average at launch and at exit}. Output goes to <workdir>/<run dir name>.log, whose tail is in the
    RunFailed raised when the process fails."""
    log_path = os.path.join(workdir, os.path.basename(run_dir) + ".log")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    load = [os.getloadavg()[0]]
    start, first = time.perf_counter(), None
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if first is None and os.path.exists(metrics) and '"loss"' in open(metrics, encoding="utf-8").read():
                first = time.perf_counter() - start
            time.sleep(poll_s)
    wall = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    if proc.returncode != 0:
        tail = open(log_path, encoding="utf-8", errors="replace").read()[-2000:]
        raise RunFailed(cmd, proc.returncode, tail)
    logs = [json.loads(line) for line in open(metrics, encoding="utf-8") if '"loss"' in line]
    return {"logs": logs, "first_log_s": first if first is not None else wall, "wall_s": wall, "load": load}


def compose_config(overrides: list):
    """train.py's config for `overrides`, validated, for benchmarks that build the pieces in-process."""
    from hydra import compose, initialize_config_dir

    from plugins import register
    from base.validate import validate

    register()
    with initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    validate(cfg)
    return cfg


def native_pieces(cfg):
    """(data, model, objective) as train.py builds them for `cfg`, on CPU in graph mode, fp32."""
    import boot  # noqa: F401  (MindSpore first, as in train.py)
    import mindspore as ms

    from data import build_data
    from models import build_model
    from objectives import objective as objective_plugin

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    t = cfg.trainer
    ms.set_seed(t.seed)
    plugin = objective_plugin(cfg.objective.name)
    data = build_data(cfg.data, t.micro_batch_size, seed=t.seed, eval_batches=1, spec=plugin.row_spec(cfg.objective))
    model = build_model(cfg.model, cfg.data.seq_len, "fp32", "CPU", t.seed)
    return data, model, plugin.Objective(cfg.objective, data.tokenizer, t.seed)
