"""The per-device memory plan of `dry_run=true` (planner/memory.py) for the 7b, 13b and 70b presets under
every layout in conf/parallel/, as one markdown table. Pure Python: nothing is built.

    scripts/venv.sh python -m benchmarks.dry_run_table

Each cell is what `python train.py model=M parallel=P device=D precision=bf16 data.seq_len=4096
trainer.micro_batch_size=1 dry_run=true` plans: the same composed and validated config, the same memory_plan
call. Recompute is the model preset's (none). Flash attention is auto, on for ascend910b and off for h100
(MindSpore has no GPU kernel), so activations and totals are given per device as "910B / H100". Fits: total
<= the device's memory_gb in GiB, as format_plan decides. Layouts base/validate.py refuses show its reason.
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import argparse
import os

from hydra import compose, initialize_config_dir

from base.schema import REPO_ROOT
from plugins import register
from base.validate import ConfigError, validate
from planner.dry_run import config_plan
from planner.layout import Layout
from planner.memory import GIB

MODELS = ("7b", "13b", "70b")
DEVICES = ("ascend910b", "h100")
COMMON = ["precision=bf16", "data.seq_len=4096", "trainer.micro_batch_size=1", "dry_run=true"]
LAYOUTS = sorted(f[:-5] for f in os.listdir(os.path.join(REPO_ROOT, "conf", "parallel")) if f.endswith(".yaml"))


def plan(model: str, layout: str, device: str, extra=()):
    """The composed config and its memory plan, as train.py's dry run computes them (ConfigError if refused)."""
    cfg = compose("config", overrides=[f"model={model}", f"parallel={layout}", f"device={device}", *COMMON, *extra])
    validate(cfg)  # dry_run=true: the rules on the launching machine are skipped, as in train.py
    return cfg, config_plan(cfg)


def row(model: str, layout: str, extra=()) -> list:
    try:
        planned = [plan(model, layout, device, extra) for device in DEVICES]
    except ConfigError as err:
        return [model, layout, f"refused: {err}"] + ["-"] * 6
    cfg, first = planned[0]
    states = first.weights + first.grads + first.optimizer_states  # the same on every device

    def both(key: str) -> str:
        return " / ".join(f"{getattr(p, key) / GIB:.1f}" for _, p in planned)

    fits = [("yes" if p.total <= c.device.memory_gb * GIB else "no") + f" ({p.total / (c.device.memory_gb * GIB):.0%})"
            for c, p in planned]
    devices = Layout.from_config(cfg.parallel, cfg.model.num_layers).world_size
    return [model, layout, str(devices), f"{first.params / 1e9:.2f}B", f"{states / GIB:.1f}", both("activations"),
            both("total"), *fits]


def main() -> None:
    """Extra arguments are more overrides, e.g. long context (the issue-14 table in the README):
    python -m benchmarks.dry_run_table stage=long_context data.seq_len=32768 model.recompute=full"""
    extra = argparse.ArgumentParser().parse_known_args()[1]
    register()
    head = ["model", "layout", "devices", "params/device", "weights+grads+optimizer GiB",
            "activations GiB (910B / H100)", "total GiB (910B / H100)", "fits ascend910b (64)", "fits h100 (80)"]
    with initialize_config_dir(config_dir=os.path.join(REPO_ROOT, "conf"), version_base="1.3"):
        rows = [row(model, layout, extra) for model in MODELS for layout in LAYOUTS]
    print("bf16, seq_len 4096, micro_batch_size 1, recompute none; flash attention on for 910B, off for H100"
          + (f"; then {' '.join(extra)}" if extra else "") + "\n")
    for line in [head, ["---"] * len(head), *rows]:
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
