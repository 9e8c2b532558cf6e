"""Whole training steps under several sets of overrides, all built in one process and their steps alternating, so
every variant sees the same box (the load of a shared machine moves absolute times by tens of percent):

    scripts/venv.sh python -m benchmarks.step_variants [--steps 12] --variant NAME=KEY=VALUE,KEY=VALUE ...
        [hydra overrides for every variant, default model=small data.seq_len=256 trainer.micro_batch_size=8]

e.g. `--variant plain=model.layer_kernels=plain --variant fused=model.layer_kernels=fused`, or two implementations:
`--variant native= --variant mindformers=model.impl=mindformers` (speed_memory's ratio without the drift between
its processes; each model's own peak RSS needs speed_memory). Each step is trainer/module.py LocalModule.step,
built as train.py builds it (local_module), on one of four prepared batches (the first 4 steps compile and settle
and are left out). Printed per variant: wall ms per step, the process's CPU ms per step (user + system, all
threads; their ratio is how many cores were busy) and the last step's loss (variants of the same math agree).
"""
import argparse
import os
import time

DEFAULTS = ["model=small", "data.seq_len=256", "trainer.micro_batch_size=8"]
SETTLE = 4  # steps left out: compile, first allocations


def step_ms(variants: dict, common: list, steps: int) -> dict:
    """{name: (wall ms, CPU ms, last loss) per step} for `variants` {name: [overrides]} on top of `common`."""
    from benchmarks.measure import compose_config, native_pieces
    from trainer.module import local_module
    from trainer.optimizer import build_optimizer

    runs = {}
    for name, overrides in variants.items():
        cfg = compose_config([*common, "trainer.max_steps=100", *overrides])
        data, model, objective = native_pieces(cfg)
        module = local_module(model, objective, build_optimizer(model.trainable_params(), cfg.optim, 100), cfg)
        runs[name] = (module, [objective.batch(data.train.next_batch(), 0) for _ in range(4)])
    totals = {name: [0.0, 0.0, None] for name in runs}
    for i in range(steps + SETTLE):
        for name, (module, batches) in runs.items():
            start, cpu = time.perf_counter(), os.times()
            loss = module.step([batches[i % 4]], 1.0).loss
            end = os.times()
            if i >= SETTLE:
                totals[name][0] += time.perf_counter() - start
                totals[name][1] += (end.user - cpu.user) + (end.system - cpu.system)
                totals[name][2] = loss
    return {name: (wall / steps * 1000, cpu / steps * 1000, loss) for name, (wall, cpu, loss) in totals.items()}


def print_steps(results: dict, label: str) -> None:
    for name, (wall, cpu, loss) in results.items():
        print(f"{label}, {name}: wall {wall:.0f} ms, CPU {cpu:.0f} ms ({cpu / wall:.2f} cores busy), "
              f"loss {loss:.4f}, load {os.getloadavg()[0]:.2f}", flush=True)


def parse_variant(text: str) -> tuple:
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME=KEY=VALUE[,KEY=VALUE...]")
    return name, [o for o in overrides.split(",") if o]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", type=parse_variant, action="append", required=True)
    p.add_argument("--steps", type=int, default=12)
    args, common = p.parse_known_args()
    import boot  # noqa: F401  (MindSpore first)

    print_steps(step_ms(dict(args.variant), common or DEFAULTS, args.steps), f"step ({' '.join(common or DEFAULTS)})")


if __name__ == "__main__":
    main()
