"""Evaluate a checkpoint: per-source loss, perplexity and bits per byte next to a unigram baseline, loss by
position in the context, passkey retrieval, and lm-evaluation-harness style tasks; fill-mask accuracy for BERT.

    python -m evaluation CKPT                                    # the checkpoint's own data, every built task
    python -m evaluation CKPT data=corpora_5dom tasks=[definitions_mc,cloze_code] --out results.json
    python -m evaluation CKPT eval.batches=0 eval.context_lengths=[256,512,1024] eval.position_bucket=64
    python -m evaluation CKPT data=corpora_5dom model.rope_scaling.type=linear model.rope_scaling.factor=4 \\
        eval.context_lengths=[1024] tasks=[]

The arguments after CKPT are train.py's Hydra overrides, composed over the checkpoint's own config: its model
(single keys may be overridden, `model=<preset>` is refused), and unless given, its data, objective and
validation batching, so the `loss` column reproduces its training's val_loss (evaluation/config.py says how).
`tasks=[a,b]` and `eval.<key>=value` are this command's own: `tasks=[]` runs none; without `tasks=` every
<tasks dir>/*.jsonl runs when the objective scores tokens (`python -m builders.tasks build` writes them). A
name is <tasks dir>/<name>.jsonl, a path ending in .jsonl is itself; an Alpaca file (data=instructions'
val.jsonl) is a generation task (evaluation/tasks.py).

What is measured, and how, is evaluation/'s: sources.py (loss, bits per byte, unigram baseline, loss by
position, fill-mask accuracy), passkey.py, tasks.py and scorer.py.
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import json
import os
import sys
from argparse import RawDescriptionHelpFormatter
from typing import Optional, Sequence

import numpy as np
from omegaconf import OmegaConf

from base.errors import ArgumentParser, entry_point
from evaluation.config import compose_config, eval_keys_help, split_arguments
from plugins import register

register()


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m evaluation", description=__doc__.split("\n\n")[0],
                            epilog="eval.<key>=value (default, what it sets):\n" + eval_keys_help(),
                            formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint: a run directory, its checkpoints/ or latest, or a step "
                        "directory (.../checkpoints/step_NNNNNN)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides, tasks=[...], eval.<key>=value")
    parser.add_argument("--out", default=None, help="JSON results file (default: eval.json in the checkpoint's step directory)")
    parser.add_argument("--tasks-dir", default=None, help="where task names are looked up (default: "
                        "${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/tasks)")
    args = parser.parse_intermixed_args(argv)
    from base import checkpoint
    from base.registry import OBJECTIVES
    from evaluation.report import format_report
    from evaluation.run import run
    from evaluation.tasks import load_tasks
    from trainer.runtime import init_runtime

    eval_cfg, task_names, overrides = split_arguments(args.overrides)
    args.checkpoint = checkpoint.resolve(args.checkpoint)  # a run, its checkpoints/, `latest` or a step
    cfg = compose_config(args.checkpoint, overrides)
    if task_names is None and OBJECTIVES[cfg.objective.name].Objective.token_nll is None:
        task_names = []  # the built tasks are scored by log-likelihood: an objective with a per-token NLL's
    from data.samples import template_of  # Alpaca task files are prompted as the checkpoint was tuned

    template = template_of(OmegaConf.load(os.path.join(args.checkpoint, "config.yaml")))
    tasks = load_tasks(task_names, args.tasks_dir, eval_cfg.max_items, template)
    init_runtime(cfg)
    results = run(args.checkpoint, cfg, eval_cfg, tasks)
    results["overrides"] = list(args.overrides)
    print()
    print(format_report(results))
    out = args.out or os.path.join(args.checkpoint, "eval.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=_json_default)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
