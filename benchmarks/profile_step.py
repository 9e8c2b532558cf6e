"""Where a training step's time goes: MindSpore's CPU profiler on the native model's step, torch.profiler on
the PyTorch reference's (benchmarks/torch_reference.py, same shapes, batches and initial weights).

    scripts/venv.sh python -m benchmarks.profile_step [--steps 3] [--warmup 2] [hydra overrides, default model=small]

MindSpore side (`mindspore.profiler.profile(activities=[ProfilerActivity.CPU])` around --steps steps of
trainer/module.py's LocalModule, after --warmup steps that compile): the profiler writes one line per kernel
to FRAMEWORK/cpu_op_execute_timestamp_<rank>.txt (`scope/Type-opN;HostCpuOps;start_ns,duration_ms,tid ...`);
those durations are summed per kernel type, per scope (forward = Default/loss_net, backward = Gradients and
the expanded *Grad composites, optimizer = the clip-and-update graph) and per custom kernel (kernels/*.cc: the
cell that calls it and the scope, all layers together). PyTorch side: torch.profiler's self CPU
time per aten op over the same number of steps, `eager` and `sdpa` attention. The matmul share is the time in
GEMM kernels (MindSpore MatMul/BatchMatMul, kernels/layers.cc's LinearKernel, aten mm/bmm/addmm/baddbmm) over
the summed kernel time; the profiled steps' wall time is printed next to it (kernels run one after another, each
on all threads).
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Dict, Iterable, Tuple

from benchmarks.measure import ROOT

DEFAULTS = ["model=small", "data.seq_len=256", "trainer.micro_batch_size=8"]
GEMM_CELLS = ("LinearKernel",)  # custom kernels that are GEMMs (kernels/layers.cc's sgemm products)
MS_MATMULS = ("MatMul", "BatchMatMul", "MatMulExt", "BatchMatMulExt", *(f"Custom ({c})" for c in GEMM_CELLS))
TORCH_MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def parse_ms_timestamps(lines: Iterable[str]) -> Tuple[Dict[str, float], Dict[str, float], Dict[str, float]]:
    """({kernel type: total ms}, {scope: total ms}, {custom kernel: total ms}) from MindSpore's
    cpu_op_execute_timestamp_<rank>.txt lines
    `Default/loss_net-CausalLMLoss/.../MatMul-op12;HostCpuOps;<start_ns>,<ms>,<tid> <start_ns>,<ms>,<tid> ...`.
    A custom kernel (kernels/*.cc, type Custom) is named by the cell that calls it and its scope, e.g.
    "FusedAttention, backward": one entry for all layers; a GEMM_CELLS one is a type of its own, "Custom
    (LinearKernel)", which counts in the matmul share."""
    by_type, by_scope, by_custom = defaultdict(float), defaultdict(float), defaultdict(float)
    for line in lines:
        if not line.strip():
            continue
        name, _, records = line.strip().split(";", 2)
        ms = sum(float(record.split(",")[1]) for record in records.split())
        kind = name.rsplit("/", 1)[-1].rsplit("-op", 1)[0]
        scope = ms_scope(name)
        if kind == "Custom":
            cells = [part.split("-", 1)[1] for part in name.split("/")[:-1] if "-" in part]
            cell = cells[-1] if cells else "?"
            by_custom[f"{cell}, {scope.split(' ')[0]}"] += ms
            kind = f"Custom ({cell})" if cell in GEMM_CELLS else kind
        by_type[kind] += ms
        by_scope[scope] += ms
    return dict(by_type), dict(by_scope), dict(by_custom)


def ms_scope(name: str) -> str:
    parts = name.split("/")
    if parts[0] == "Gradients" or (parts[0] == "Expand" and parts[1].endswith(("Grad", "Backward"))):
        return "backward"
    if parts[0] == "Default" and len(parts) > 2 and parts[1].startswith("update"):
        return "optimizer (clip + AdamW)"
    if parts[0] == "Default" and len(parts) > 2 and parts[1].startswith("loss_net"):
        return "forward (+ loss)"
    return "other (" + "/".join(p.rsplit("-op", 1)[0] for p in parts[:2]) + ")" if len(parts) > 1 else "other"


def op_table(by_op: Dict[str, float], matmuls: Iterable[str], top: int = 15, label: str = "op") -> Tuple[str, float]:
    """(a table of the `top` ops by time with their share, the share of the `matmuls` ops in the total)."""
    total = sum(by_op.values())
    rows = sorted(by_op.items(), key=lambda kv: -kv[1])
    lines = [f"{label:<56} {'ms':>10} {'share':>7}"]
    lines += [f"{op[:56]:<56} {ms:>10.1f} {ms / total:>7.1%}" for op, ms in rows[:top]]
    if len(rows) > top:
        rest = sum(ms for _, ms in rows[top:])
        lines.append(f"{f'({len(rows) - top} more)':<56} {rest:>10.1f} {rest / total:>7.1%}")
    matmul = sum(ms for op, ms in by_op.items() if op in matmuls) / total
    lines.append(f"{'total kernel time':<56} {total:>10.1f}   matmul share {matmul:.1%}")
    return "\n".join(lines), matmul


def profile_native(overrides: list, warmup: int, steps: int, out_dir: str) -> None:
    import mindspore.profiler as msprof

    from benchmarks.measure import compose_config, native_pieces
    from trainer.module import local_module
    from trainer.optimizer import build_optimizer

    cfg = compose_config([*overrides, f"trainer.max_steps={warmup + steps}"])
    data, model, objective = native_pieces(cfg)
    module = local_module(model, objective, build_optimizer(model.trainable_params(), cfg.optim, cfg.trainer.max_steps),
                          cfg)

    def step():
        return module.step([objective.batch(data.train.next_batch(), 0)], 1.0)

    for _ in range(warmup):
        step()
    prof = msprof.profile(activities=[msprof.ProfilerActivity.CPU],
                          on_trace_ready=msprof.tensorboard_trace_handler(out_dir))
    prof.start()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall = time.perf_counter() - start
    prof.stop()
    files = glob.glob(os.path.join(out_dir, "*", "FRAMEWORK", "cpu_op_execute_timestamp_*.txt"))
    if not files:
        print(f"MindSpore's profiler wrote no cpu_op_execute_timestamp file under {out_dir}: "
              f"{sorted(glob.glob(os.path.join(out_dir, '**'), recursive=True))}")
        return
    with open(files[0], encoding="utf-8") as f:
        by_type, by_scope, by_custom = parse_ms_timestamps(f)
    print(f"MindSpore native, {steps} steps after {warmup} ({' '.join(overrides)}): wall {wall * 1000:.0f} ms, "
          f"load {os.getloadavg()[0]:.2f}; source {os.path.relpath(files[0], out_dir)}")
    print(op_table(by_type, MS_MATMULS)[0])
    print(op_table(by_scope, (), top=6, label="scope")[0].rsplit("\n", 1)[0])
    print(op_table(by_custom, (), top=12, label="custom kernel (kernels/*.cc), scope")[0].rsplit("\n", 1)[0])


def profile_torch(export_dir: str, attention: str, warmup: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.torch_reference import batches, trainer

    step, _ = trainer(export_dir, attention)
    rows = batches(export_dir)
    for update in range(warmup):
        step(update, rows[update]).item()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for update in range(warmup, warmup + steps):
            step(update, rows[update]).item()
        wall = time.perf_counter() - start
    by_op = {e.key: e.self_cpu_time_total / 1000 for e in prof.key_averages()}
    print(f"PyTorch {attention}, {steps} steps after {warmup}: wall {wall * 1000:.0f} ms (profiled), "
          f"load {os.getloadavg()[0]:.2f}")
    print(op_table(by_op, TORCH_MATMULS)[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", choices=("native", "torch_eager", "torch_sdpa"), help=argparse.SUPPRESS)
    p.add_argument("--export", help=argparse.SUPPRESS)
    args, overrides = p.parse_known_args()
    overrides = [*DEFAULTS, *overrides]
    if args.only == "native":
        with tempfile.TemporaryDirectory() as out_dir:
            profile_native(overrides, args.warmup, args.steps, out_dir)
        return
    if args.only:
        profile_torch(args.export, args.only[len("torch_"):], args.warmup, args.steps)
        return
    me = [sys.executable, "-m", "benchmarks.profile_step", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory() as work:  # each side in its own process, one after the other
        export = os.path.join(work, "export")
        subprocess.run([sys.executable, "-m", "benchmarks.torch_reference", "export", export, *overrides,
                        f"trainer.max_steps={args.warmup + args.steps}"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        for only in ("native", "torch_eager", "torch_sdpa"):
            print(flush=True)
            subprocess.run([*me, "--only", only, "--export", export, *overrides[len(DEFAULTS):]], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
