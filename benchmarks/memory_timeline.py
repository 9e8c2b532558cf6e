"""Where a training process's memory and time go, phase by phase, and where its peak RSS goes: imports, model
build, the compilation of the step's graphs, the first step, the steady state.

    scripts/venv.sh python -m benchmarks.memory_timeline [model=small] [steps=5] [other train.py overrides]

One process, in-process: the cells train.py builds (models.build_model, the objective's loss cell,
trainer/module.py local_module: one graph per step at grad_accum=1 on one device, TrainStep, else ForwardBackward
and ApplyUpdate), random tokens instead of the data pipeline (the loader is not what holds memory). A thread
samples /proc/self/status every 10 ms; each phase's row gives its wall time, VmRSS at its end, the highest VmRSS
sampled during it, and VmHWM (the kernel's peak so far). Each graph is compiled with `Cell.compile` before it
first runs, so a compile row is the compiler alone and the run row after it is execution alone.

The last table splits the peak (VmHWM) by phase: what the imports hold, what the model build added (the
weights), what compiling added, and what running added (MindSpore's memory pool: gradients, activations, logits,
workspaces; and AdamW's moments, zeros not resident before the first step), each beside the dry run's plan for
the same config (planner/memory.py), which counts the tensors only. MindSpore's pool statistics
(`mindspore.runtime.max_memory_allocated` and the like) read 0 on CPU in 2.9, so RSS is what is measured.
"""
import time

T0 = time.perf_counter()

import boot  # noqa: E402,F401  (MindSpore first, as in train.py)

import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from benchmarks.results import recorded


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class Sampler(threading.Thread):
    """The highest VmRSS seen since the last `mark`."""

    def __init__(self, every: float = 0.01):
        super().__init__(daemon=True)
        self.every, self.high, self.running = every, status_kib("VmRSS"), True

    def run(self):
        while self.running:
            self.high = max(self.high, status_kib("VmRSS"))
            time.sleep(self.every)

    def mark(self) -> int:
        high, self.high = max(self.high, status_kib("VmRSS")), status_kib("VmRSS")
        return high


def main(argv):
    sampler = Sampler()
    sampler.start()
    rows, last = [], [T0]
    gib = lambda kib: kib / 2**20

    def phase(name: str):
        now = time.perf_counter()
        rows.append((name, now - last[0], gib(status_kib("VmRSS")), gib(sampler.mark()), gib(status_kib("VmHWM"))))
        last[0] = now

    steps = int(next((a.split("=", 1)[1] for a in argv if a.startswith("steps=")), 5))
    overrides = [a for a in argv if not a.startswith("steps=")]
    if not any(a.startswith("model=") for a in overrides):
        overrides.append("model=small")
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hydra import compose, initialize_config_dir

    from plugins import register
    from models import build_model
    from objectives import objective as objective_plugin
    from trainer.module import local_module
    from trainer.optimizer import build_optimizer
    from trainer.runtime import init_runtime

    register()
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(boot.__file__), "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    init_runtime(cfg)
    phase("imports + context")

    t = cfg.trainer
    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device, t.seed)
    objective = objective_plugin(cfg.objective.name).Objective(cfg.objective, None, t.seed)
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, t.max_steps)
    module = local_module(model, objective, optimizer, cfg)
    phase("model + optimizer build")

    rng = np.random.default_rng(0)
    tokens = lambda: rng.integers(0, cfg.model.vocab_size, (t.micro_batch_size, cfg.data.seq_len + 1), np.int32)
    inputs = tuple(map(Tensor, objective.batch({"input_ids": tokens()}, 0)))
    scale, allow, limit = Tensor(1.0, ms.float32), Tensor(True), Tensor(np.inf, ms.float32)
    if module.train_step is not None:  # one graph: forward, backward and update
        module.train_step.compile(scale, limit, *inputs)
        phase("compile TrainStep")
        loss = module.train_step(scale, limit, *inputs)[0].asnumpy()
        phase("run TrainStep (1st)")
    else:
        module.forward_backward.compile(scale, *inputs)
        phase("compile ForwardBackward")
        loss = module.forward_backward(scale, *inputs)[0].asnumpy()
        phase("run ForwardBackward (1st)")
        module.apply_update.compile(scale, allow)
        phase("compile ApplyUpdate")
        module.apply_update(scale, allow)[0].asnumpy()
        phase("run ApplyUpdate (1st)")
    time_to_first_step = time.perf_counter() - T0
    start = time.perf_counter()
    for _ in range(steps):
        result = module.step([objective.batch({"input_ids": tokens()}, 0)], 1.0)
    steady = time.perf_counter() - start
    phase(f"{steps} more steps")
    sampler.running = False

    print(f"model={cfg.model.name} {t.micro_batch_size}x{cfg.data.seq_len} tokens/step, mode={t.mode}, "
          f"overrides {' '.join(overrides)}")
    print(f"{'phase':28s} {'seconds':>8s} {'RSS end GiB':>12s} {'RSS max GiB':>12s} {'HWM GiB':>8s}")
    for name, seconds, rss, high, hwm in rows:
        print(f"{name:28s} {seconds:8.2f} {rss:12.2f} {high:12.2f} {hwm:8.2f}")
    tokens_per_step = t.micro_batch_size * cfg.data.seq_len
    print(f"time to the first optimizer step: {time_to_first_step:.1f} s (process start to the first update)")
    print(f"steady state: {steps * tokens_per_step / steady:.0f} tokens/s; first loss {float(loss):.4f}, "
          f"last {result.loss:.4f}")
    print()
    print(peak_table(rows, plan_of(cfg)))


def plan_of(cfg) -> dict:
    """The dry run's plan for `cfg` in GiB: {"weights": ..., "the rest": grads, activations, logits, AdamW m, v}."""
    from planner.dry_run import config_plan
    from planner.memory import GIB

    plan = config_plan(cfg)
    return {"weights": plan.weights / GIB,
            "the rest": (plan.grads + plan.activations + plan.logits + plan.optimizer_states) / GIB}


def peak_table(rows, plan: dict) -> str:
    """The peak (the last row's VmHWM) split by what each phase added to the process's highest RSS so far.
    `rows`: (phase, seconds, RSS at its end, highest RSS during it, VmHWM) in GiB; compile and run rows are
    summed (with two graphs: both compiles, both runs)."""
    added = {"imports": rows[0][4], "build": 0.0, "compile": 0.0, "run": 0.0}
    for (_, _, _, _, before), (name, _, _, _, after) in zip(rows, rows[1:]):
        part = "build" if "build" in name else "compile" if name.startswith("compile") else "run"
        added[part] += after - before
    lines = [
        ("Python, MindSpore and the other imports", added["imports"], ""),
        ("model build: the weights", added["build"], f"plan {plan['weights']:.2f}"),
        ("compiling the step's graphs", added["compile"], "not in the plan"),
        ("running: MindSpore's memory pool, AdamW m, v", added["run"],
         f"plan {plan['the rest']:.2f} (grads, activations, logits, m, v)"),
        ("peak RSS (VmHWM)", rows[-1][4], ""),
    ]
    return "\n".join([f"{'where the peak goes':44s} {'GiB':>6s}"] +
                     [f"{name:44s} {gib:6.2f}  {note}".rstrip() for name, gib, note in lines])


if __name__ == "__main__":
    with recorded("benchmarks.memory_timeline", "Where a training process's memory and time go"):
        main(sys.argv[1:])
