"""The whole training step against PyTorch: per-step losses of mindlab and of an independent reference.

    scripts/venv.sh python -m benchmarks.step_reference [optim=adamw_bert] [trainer.grad_accum=2] [steps=120] ...

Both sides start from the same weights (mindlab's initialization, exported with the Hugging Face adapter,
models/llama/hf.py) and see the same micro-batches in the same order (mindlab's loader). mindlab runs its own
step (trainer/module.py LocalModule: accumulation weighted by loss tokens, global-norm clipping, the optimizer
preset and its schedule); the reference is transformers' LlamaForCausalLM + torch.optim.AdamW over the same
decay groups, the same warmup-cosine formula (MindFormers' CosineWithWarmUpLR) and
torch.nn.utils.clip_grad_norm_. fp32 on CPU. The table prints the two losses and their relative difference;
the pass criteria are the issue's: <= 1e-5 over the first 20 steps and <= 1e-3 from step 100 on.
"""
import math
import os
import sys
from typing import List, Tuple

import boot  # noqa: F401  (MindSpore first, as in train.py)
import numpy as np

FIRST_STEPS, EARLY_TOL, LATE_STEP, LATE_TOL = 20, 1e-5, 100, 1e-3
DEFAULTS = ["experiment=tiny_pretrain", "trainer.micro_batch_size=4", "data.seq_len=128", "optim.lr=2e-3",
            "optim.min_lr=2e-4", "optim.warmup_steps=5"]


def reference_lr(optim, update: int, max_steps: int) -> float:
    """MindFormers' CosineWithWarmUpLR at `update` applied updates (warmup from 0, then cosine to min_lr)."""
    from trainer.optimizer import warmup_steps

    warmup = warmup_steps(optim, max_steps)
    if update >= max_steps:
        return optim.min_lr
    if warmup and update < warmup:
        return optim.lr * update / warmup
    progress = (update - warmup) / max(1, max_steps - warmup)
    return optim.min_lr + (optim.lr - optim.min_lr) * max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def mindlab_run(cfg, steps: int) -> Tuple[dict, List[List[tuple]], List[float]]:
    """(initial weights by mindlab name, the micro-batches of each step, mindlab's per-step losses)."""
    import mindspore as ms

    from data import build_data
    from models import build_model
    from objectives import objective as objective_plugin
    from trainer.module import LocalModule
    from trainer.optimizer import build_optimizer

    t = cfg.trainer
    ms.set_seed(t.seed)
    plugin = objective_plugin(cfg.objective.name)
    data = build_data(cfg.data, t.micro_batch_size, seed=t.seed, eval_batches=1, spec=plugin.row_spec(cfg.objective))
    model = build_model(cfg.model, cfg.data.seq_len, "fp32", "CPU", t.seed)
    initial = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    objective = plugin.Objective(cfg.objective, data.tokenizer, t.seed)
    module = LocalModule(model, objective, build_optimizer(model.trainable_params(), cfg.optim, t.max_steps),
                         cfg.optim.clip_grad_norm)
    def next_inputs() -> tuple:  # as trainer/loop.py: the batch's first sample index, then the batch
        sample = data.train.position
        return objective.batch(data.train.next_batch(), sample)

    batches, losses = [], []
    for _ in range(steps):
        micro = [next_inputs() for _ in range(t.grad_accum)]
        batches.append(micro)
        losses.append(module.step(micro, 1.0, lambda loss: None).loss)
    return initial, batches, losses


def torch_run(cfg, initial: dict, batches: List[List[tuple]]) -> List[float]:
    """The same steps in PyTorch: LlamaForCausalLM + torch.optim.AdamW, the same groups, schedule, clipping."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.llama import hf
    from trainer.optimizer import decays

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**hf.hf_config(cfg.model), attn_implementation="eager")).float()
    names = {hf._rename(name, hf.HF_NAMES): name for name in initial}  # HF name -> mindlab name
    model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.to_hf(initial).items()}, strict=True)
    params = dict(model.named_parameters())
    o = cfg.optim
    groups = [{"params": [p for n, p in params.items() if decays(names[n], o)], "weight_decay": o.weight_decay},
              {"params": [p for n, p in params.items() if not decays(names[n], o)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    ignore = cfg.objective.ignore_index
    losses = []
    for update, micro in enumerate(batches):
        counts = [int(np.count_nonzero(labels[:, 1:] != ignore)) for _, labels in micro]
        loss_sum = 0.0
        for (input_ids, labels), n in zip(micro, counts):
            logits = model(torch.from_numpy(input_ids[:, :-1].astype(np.int64))).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     torch.from_numpy(labels[:, 1:].astype(np.int64)).reshape(-1),
                                                     ignore_index=ignore)
            (loss * n / sum(counts)).backward()
            loss_sum += loss.item() * n / sum(counts)
        if o.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad_norm)
        for group in opt.param_groups:
            group["lr"] = reference_lr(o, update, cfg.trainer.max_steps)
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum)
    return losses


def compare(overrides: List[str], steps: int) -> List[Tuple[int, float, float, float]]:
    """(step, mindlab loss, PyTorch loss, relative difference) for `steps` steps of train.py's config with
    DEFAULTS and `overrides`."""
    from hydra import compose, initialize_config_dir

    from conf.schema import REPO_ROOT, register
    from conf.validate import validate

    register()
    with initialize_config_dir(os.path.join(REPO_ROOT, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*DEFAULTS, f"trainer.max_steps={steps}", *overrides])
    validate(cfg)
    initial, batches, ours = mindlab_run(cfg, steps)
    theirs = torch_run(cfg, initial, batches)
    return [(i + 1, a, b, abs(a - b) / abs(b)) for i, (a, b) in enumerate(zip(ours, theirs))]


def verdict(rows) -> List[str]:
    """The criteria each failing row breaks (empty: all pass)."""
    failures = [f"step {s}: rel diff {d:.2e} > {EARLY_TOL:g}" for s, _, _, d in rows if s <= FIRST_STEPS and d > EARLY_TOL]
    return failures + [f"step {s}: rel diff {d:.2e} > {LATE_TOL:g}" for s, _, _, d in rows if s >= LATE_STEP and d > LATE_TOL]


def main() -> None:
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    args = sys.argv[1:]
    steps = next((int(a.split("=")[1]) for a in args if a.startswith("steps=")), 120)
    overrides = [a for a in args if not a.startswith("steps=")]
    rows = compare(overrides, steps)
    print(f"overrides: {' '.join(DEFAULTS + overrides)}, {steps} steps, fp32 CPU")
    print(f"{'step':>5} {'mindlab loss':>13} {'PyTorch loss':>13} {'rel diff':>10}")
    for s, a, b, d in rows:
        if s <= FIRST_STEPS or s % 10 == 0:
            print(f"{s:>5} {a:>13.7f} {b:>13.7f} {d:>10.2e}")
    early = max(d for s, _, _, d in rows if s <= FIRST_STEPS)
    late = max((d for s, _, _, d in rows if s >= LATE_STEP), default=float("nan"))
    failures = verdict(rows)
    print(f"max rel diff: steps 1-{FIRST_STEPS} {early:.2e} (<= {EARLY_TOL:g}), steps >= {LATE_STEP} {late:.2e} "
          f"(<= {LATE_TOL:g}): {'PASS' if not failures else f'FAIL ({len(failures)} steps)'}")


if __name__ == "__main__":
    main()
