"""Host memory of one rank building a sharded run, before its compile: the model, AdamW and the pipeline step.

    python -m benchmarks.sharded_build                      # model=70b parallel=tp8pp4 on ascend910b
    python -m benchmarks.sharded_build --model 13b --parallel tp8pp2

A sharded build (base.schema.is_sharded) leaves the weights, AdamW's moments and the pipeline's accumulation
buffers to the semi-auto compile, which initialises each rank's slices only (models.deferred_initialisation). This
builds those cells here, on CPU, exactly as trainer/module.py ShardedModule does up to its compile, and prints the
process's resident memory after each part, beside what the same parameters would take materialised whole in fp32
(weights, two moments, the accumulation buffers): the memory every rank would need without the deferral.
"""
import boot  # noqa: F401  (first: imports MindSpore before anything that loads protobuf)

import argparse
import os
import sys
import time

from benchmarks.results import write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_gib() -> float:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def measure(model_preset: str, parallel: str, device: str) -> dict:
    from hydra import compose, initialize_config_dir

    import plugins
    from models import build_model
    from objectives import objective as objective_plugin
    from trainer.module import loss_cell
    from trainer.optimizer import build_optimizer
    from trainer.step import ShardedTrainStep

    plugins.register()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model_preset}", f"parallel={parallel}",
                                                       f"device={device}"])
    p, rows = cfg.parallel, {"start": rss_gib()}
    start = time.perf_counter()
    model = build_model(cfg.model, cfg.data.seq_len, cfg.device.compute_dtype, cfg.device, 0, sharded=True)
    rows["model"] = rss_gib()
    optimizer = build_optimizer(model.trainable_params(), cfg.optim, 10, cfg.device, sharded=True)
    rows["AdamW"] = rss_gib()
    objective = objective_plugin(cfg.objective.name).Objective(cfg.objective)
    ShardedTrainStep(loss_cell(objective, model), optimizer, cfg.optim.clip_grad_norm, p.pp, p.micro_batches,
                     p.optimizer_shard)
    rows["step"] = rss_gib()
    params = sum(param.size for param in model.trainable_params())
    buffers = 1 if p.pp > 1 else 0
    return {"rows": rows, "params": params, "seconds": time.perf_counter() - start, "buffers": buffers,
            "whole_gib": params * 4 * (3 + buffers) / 2**30}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="70b")
    parser.add_argument("--parallel", default="tp8pp4")
    parser.add_argument("--device", default="ascend910b")
    args = parser.parse_args(argv)
    out = measure(args.model, args.parallel, args.device)
    lines = [f"model={args.model} parallel={args.parallel} device={args.device}: {out['params'] / 1e9:.2f}B "
             f"parameters, built in {out['seconds']:.1f} s", "",
             "| after | resident memory of the rank |", "| --- | --- |"]
    lines += [f"| {part} | {gib:.2f} GiB |" for part, gib in out["rows"].items()]
    buffers = ", the accumulation buffers" if out["buffers"] else ""
    lines += ["", f"Materialised whole in fp32 (weights, AdamW's two moments{buffers}), the same cells would take "
              f"{out['whole_gib']:.0f} GiB on every rank."]
    body = "\n".join(lines)
    print(body)
    write_section("benchmarks.sharded_build", "A sharded run's rank before its compile: host memory", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
