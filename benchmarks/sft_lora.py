"""Full SFT vs LoRA (r=8 and r=64) on data=instructions, from one model=small pretrain, side by side in one run:
held-out response loss and token accuracy before and after, trainable parameters, peak RSS and tokens/s.

    scripts/venv.sh python -m builders.instructions                 # once: the instruction set
    scripts/venv.sh python -m benchmarks.sft_lora [--base CKPT] [--pretrain-steps 300] [--steps 150] [overrides]

Without --base it first pretrains model=small on data=corpora_5dom (the domains the instructions come from).
Each SFT run is its own process (so peak RSS is its own), with the same data, batch, schedule and steps;
tokens/s is averaged after the first logging interval (graph compilation). "before" is the base model on the
same held-out batches, through the same evaluation code.
"""
import argparse
import json
import os
import tempfile

import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

from benchmarks.measure import ROOT, train_and_measure
from benchmarks.results import recorded

SFT = ["stage=sft", "model=small", "data=instructions", "data.seq_len=512", "trainer.micro_batch_size=4",
       "trainer.log_every=10", "trainer.eval_batches=8", "logger.progress_bar=false"]
RUNS = {"full": ["peft=none", "optim.lr=1e-4"], "lora r=8": ["peft=lora", "peft.r=8", "optim.lr=1e-3"],
        "lora r=64": ["peft=lora", "peft.r=64", "peft.alpha=128", "optim.lr=1e-3"]}


def held_out_before(base: str, overrides: list) -> dict:
    """The base checkpoint's held-out response loss and accuracy (the Evaluation callback's numbers)."""
    import mindspore as ms
    from hydra import compose, initialize_config_dir

    from base import checkpoint
    from plugins import register
    from data import build_data
    from models import build_model
    from objectives import objective
    from trainer.callbacks import Callback, Evaluation
    from trainer.module import LocalModule
    from trainer.optimizer import build_optimizer

    register()
    with initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*SFT, f"stage.init_from={base}", *overrides])
    ms.set_context(mode=ms.GRAPH_MODE)
    plugin = objective(cfg.objective.name)
    data = build_data(cfg.data, cfg.trainer.micro_batch_size, eval_batches=cfg.trainer.eval_batches,
                      spec=plugin.row_spec(cfg.objective))
    model = build_model(cfg.model, cfg.data.seq_len, "fp32", "CPU", 0)
    checkpoint.load_weights(base, model)
    obj = plugin.Objective(cfg.objective, data.tokenizer)
    module = LocalModule(model, obj, build_optimizer(model.trainable_params(), cfg.optim, 10), 1.0)
    val = {s: [obj.batch(b, -1 - i) for i, b in enumerate(batches)] for s, batches in data.val.items()}
    return Evaluation(Callback(), 0, 0, False, module, val).evaluate()


def trainable(ckpt: str) -> int:
    """Parameters a run trained: what its checkpoint's model file holds (a LoRA run saves its adapters only)."""
    from safetensors.numpy import load_file

    return sum(a.size for a in load_file(os.path.join(ckpt, "model.safetensors")).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="a model=small checkpoint; default: pretrain one first")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=150)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as workdir:
        base = args.base
        if base is None:
            pre = train_and_measure("pretrain", [
                "model=small", "data=corpora_5dom", f"trainer.max_steps={args.pretrain_steps}",
                "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.eval_batches=1", "optim.lr=1e-3",
                "optim.min_lr=1e-4", "optim.warmup_steps=30", "logger.progress_bar=false"], workdir)
            base = os.path.join(workdir, "pretrain", "checkpoints", f"step_{args.pretrain_steps:06d}")
            print(f"pretrain: {args.pretrain_steps} steps of model=small on corpora_5dom, final loss "
                  f"{pre['final_loss']:.3f}, {pre['tokens_per_sec']:.0f} tokens/s")
        before = held_out_before(base, overrides)
        results = {}
        for name, extra in RUNS.items():
            run = [*SFT, f"stage.init_from={base}", f"trainer.max_steps={args.steps}", "optim.warmup_steps=15",
                   f"trainer.eval_every={args.steps}", *extra, *overrides]
            run_dir = os.path.join(workdir, name.replace(" ", "_").replace("=", ""))
            results[name] = train_and_measure(os.path.basename(run_dir), run, workdir)
            lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
            results[name]["val"] = [m for m in lines if "val_loss" in m][-1]
            results[name]["trainable"] = trainable(os.path.join(run_dir, "checkpoints", f"step_{args.steps:06d}"))
    print(f"SFT: {args.steps} steps, {' '.join(SFT)} {' '.join(overrides)}")
    print(f"{'run':<10} {'held-out loss':>14} {'token acc':>10} {'trainable':>12} {'tokens/s':>9} {'peak RSS GiB':>13}")
    print(f"{'before':<10} {before['val_loss']:>14.4f} {before['val_mean_token_accuracy']:>10.4f}")
    for name, r in results.items():
        print(f"{name:<10} {r['val']['val_loss']:>14.4f} {r['val']['val_mean_token_accuracy']:>10.4f} "
              f"{r['trainable']:>12,} {r['tokens_per_sec']:>9.0f} {r['peak_rss_gb']:>13.2f}")


if __name__ == "__main__":
    with recorded("benchmarks.sft_lora", "Full SFT against LoRA"):
        main()
