"""The dry run as a layout advisor (planner/advisor.py) for 7b, 13b and 70b at 4k, 32k and 128k tokens on 1, 2, 4 and
16 nodes of Ascend 910B and of H100: the fastest layout that fits each, its predicted throughput and memory, and how
long the dry run took. Pure Python: nothing is built.

    scripts/venv.sh python -m benchmarks.dry_run_table            # the table, also written into benchmarks/RESULTS.md
    scripts/venv.sh python -m benchmarks.dry_run_table --presets  # the memory plan of every conf/parallel preset

Each cell is what `python train.py model=M device=D nodes=N data.seq_len=S dry_run=true` prints (32k and 128k add
stage=long_context: YaRN x8 and x32 over Llama 2's 4096 positions): the same composed and validated config, the same
report; the time is that call's, in this process (Hydra's composition included, MindSpore's import not).
The global batch is the advisor's default, 4M tokens (1,024 sequences at 4k, 128 at 32k, 32 at 128k).
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import argparse
import os
import re
import time

from hydra import compose, initialize_config_dir

from base.errors import ConfigError
from base.schema import REPO_ROOT
from base.validate import validate
from benchmarks.results import write_section
from plugins import register
from planner.dry_run import config_plan, dry_run_report
from planner.layout import Layout
from planner.memory import GIB

MODELS = ("7b", "13b", "70b")
DEVICES = ("ascend910b", "h100")
NODES = (1, 2, 4, 16)
LENGTHS = {"4k": ["data.seq_len=4096"], "32k": ["stage=long_context", "data.seq_len=32768"],
           "128k": ["stage=long_context", "data.seq_len=131072"]}


def advise(device: str, model: str, length: str, nodes: int) -> list:
    """One row: the advisor's fastest layout and its numbers, or why none fits; and the seconds it took."""
    start = time.perf_counter()
    overrides = [f"model={model}", f"device={device}", f"nodes={nodes}", *LENGTHS[length], "dry_run=true"]
    try:
        cfg = compose("config", overrides=overrides)
        validate(cfg)
        report = dry_run_report(cfg, overrides)
    except ConfigError as err:
        seconds = time.perf_counter() - start
        needs = re.search(r"needs at least (\d+)", str(err))
        return [device, model, length, str(nodes), "none fits" + (f": needs {needs.group(1)} devices" if needs else ""),
                *["-"] * 5, f"{seconds:.1f}"]
    seconds = time.perf_counter() - start
    best = re.search(r"the fastest: (.+?), micro_batch_size (\d+), (.+?), recompute (\w+)", report)
    tokens = re.search(r"([\d,]+) tokens/s per device, MFU (\d+%)", report)
    memory = re.search(r"fragmentation = ([\d.]+) of ([\d.]+) usable", report)
    bubble = re.search(r"pipeline bubble [\d.e+-]+ s \((\d+%)\)", report)
    fit = re.search(r"(\d+) of (\d+) layouts fit", report)
    layout = f"{best.group(1)}, mbs {best.group(2)}, {best.group(3)}, recompute {best.group(4)}"
    return [device, model, length, str(nodes), layout, tokens.group(1), tokens.group(2),
            f"{memory.group(1)} / {memory.group(2)}", bubble.group(1), f"{fit.group(1)} / {fit.group(2)}",
            f"{seconds:.1f}"]


def advisor_table(devices=DEVICES, models=MODELS, lengths=tuple(LENGTHS), nodes=NODES) -> str:
    head = ["device", "model", "seq", "nodes", "fastest layout that fits", "tokens/s/device", "MFU",
            "memory GiB (need / usable)", "bubble", "layouts fitting", "dry run s"]
    rows = [advise(d, m, length, n) for d in devices for m in models for length in lengths for n in nodes]
    return "\n".join("| " + " | ".join(line) + " |" for line in [head, ["---"] * len(head), *rows])


def write_results(table: str) -> None:
    """The table as this benchmark's section of benchmarks/RESULTS.md."""
    write_section("benchmarks.dry_run_table", "The dry run as a layout advisor",
                  "Predicted by planner/timing.py (docs/planning.md): bf16 (precision=auto), the advisor's 4M-token "
                  "global batch, device presets as in conf/device/.\n\n" + table)


# --- --presets: the memory plan of every conf/parallel preset ------------------------------------------------

PRESET_COMMON = ["precision=bf16", "data.seq_len=4096", "trainer.micro_batch_size=1", "dry_run=true"]


def preset_row(model: str, layout: str, extra=()) -> list:
    """The memory plan of a preset layout on each device, as train.py's dry run computes it."""
    try:
        planned = []
        for device in DEVICES:
            cfg = compose("config", overrides=[f"model={model}", f"parallel={layout}", f"device={device}",
                                               *PRESET_COMMON, *extra])
            validate(cfg)
            planned.append((cfg, config_plan(cfg)))
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


def presets_table(extra) -> str:
    layouts = sorted(f[:-5] for f in os.listdir(os.path.join(REPO_ROOT, "conf", "parallel"))
                     if f.endswith(".yaml") and f != "auto.yaml")
    head = ["model", "layout", "devices", "params/device", "weights+grads+optimizer GiB",
            "activations GiB (910B / H100)", "total GiB (910B / H100)", "fits ascend910b (64)", "fits h100 (80)"]
    rows = [preset_row(model, layout, extra) for model in MODELS for layout in layouts]
    title = ("bf16, seq_len 4096, micro_batch_size 1, recompute none; flash attention on for 910B, off for H100"
             + (f"; then {' '.join(extra)}" if extra else "") + "\n")
    return title + "\n".join("| " + " | ".join(line) + " |" for line in [head, ["---"] * len(head), *rows])


def main() -> None:
    """--presets [overrides...]: the preset table, e.g. long context: --presets stage=long_context
    data.seq_len=32768 model.recompute=full. Without it: the advisor table, printed and written to RESULTS.md."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", action="store_true", help="the memory plan of every conf/parallel preset")
    parser.add_argument("--devices", nargs="+", default=DEVICES, choices=DEVICES)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--lengths", nargs="+", default=tuple(LENGTHS), choices=tuple(LENGTHS))
    parser.add_argument("--nodes", nargs="+", type=int, default=NODES)
    args, extra = parser.parse_known_args()
    register()
    with initialize_config_dir(config_dir=os.path.join(REPO_ROOT, "conf"), version_base="1.3"):
        if args.presets:
            print(presets_table(extra))
            return
        table = advisor_table(args.devices, args.models, args.lengths, args.nodes)
    print(table)
    write_results(table)


if __name__ == "__main__":
    main()
