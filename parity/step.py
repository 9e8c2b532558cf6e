"""The whole training step against PyTorch: per-step losses of mindlab and of an independent reference.

    scripts/venv.sh python -m parity.step [optim=adamw_bert] [trainer.grad_accum=2] [steps=120] ...
    scripts/venv.sh python -m parity.step bert [steps=120] ...    # BERT MLM + NSP (data=wiki)
    scripts/venv.sh python -m parity.step floor ...   # + PyTorch vs itself from weights 1 ulp away

Both sides start from the same weights (mindlab's initialization, exported with the family's Hugging Face
adapter, models/<family>/hf.py) and see the same micro-batches in the same order (mindlab's loader and
objective, masks included). mindlab runs its own step (trainer/module.py LocalModule: accumulation weighted by
loss tokens, global-norm clipping, the optimizer preset and its schedule); the reference is transformers'
LlamaForCausalLM (clm) or BertForPreTraining (mlm) + torch.optim.AdamW over the same decay groups, the same
warmup-cosine formula (MindFormers' CosineWithWarmUpLR) and torch.nn.utils.clip_grad_norm_. fp32 on CPU. The table prints the two losses and their relative difference;
the pass criteria: <= 1e-5 over the first 20 steps and <= 1e-3 from step 100 on.
"""
import math
import os
import sys
from typing import List, Tuple

import boot  # noqa: F401  (MindSpore first, as in train.py)
import numpy as np

FIRST_STEPS, EARLY_TOL, LATE_STEP, LATE_TOL = 20, 1e-5, 100, 1e-3
DEFAULTS = {  # per model family: a small run of its README stage preset, dropout off (the two sides draw differently)
    "llama": ["stage=tiny_pretrain", "trainer.micro_batch_size=4", "data.seq_len=128", "optim.lr=2e-3",
              "optim.min_lr=2e-4", "optim.warmup_steps=5"],
    "bert": ["stage=bert_tiny_mlm", "trainer.micro_batch_size=8", "optim.lr=2e-3", "optim.min_lr=2e-4",
             "optim.warmup_steps=5", "model.hidden_dropout=0", "model.attention_dropout=0"]}


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
    from trainer.module import local_module
    from trainer.optimizer import build_optimizer

    t = cfg.trainer
    ms.set_seed(t.seed)
    plugin = objective_plugin(cfg.objective.name)
    data = build_data(cfg.data, t.micro_batch_size, seed=t.seed, eval_batches=1, spec=plugin.row_spec(cfg.objective))
    model = build_model(cfg.model, cfg.data.seq_len, "fp32", "CPU", t.seed)
    initial = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    objective = plugin.Objective(cfg.objective, data.tokenizer, t.seed)
    module = local_module(model, objective, build_optimizer(model.trainable_params(), cfg.optim, t.max_steps), cfg)

    def next_inputs() -> tuple:  # as trainer/loop.py: the batch's first sample index, then the batch
        sample = data.train.position
        return objective.batch(data.train.next_batch(), sample)

    batches, losses = [], []
    for _ in range(steps):
        micro = [next_inputs() for _ in range(t.grad_accum)]
        batches.append(micro)
        losses.append(module.step(micro, 1.0).loss)
    return initial, batches, losses


def torch_model(cfg, initial: dict):
    """(the Hugging Face model holding `initial`, its parameter name -> mindlab name): the family's transformers
    class (its hf adapter's first architecture), eager attention, loaded through the adapter's to_hf."""
    import torch
    import transformers

    from models import family

    hf = family(cfg.model.family).hf
    config = {k: v for k, v in hf.hf_config(cfg.model).items() if k not in ("architectures", "model_type")}
    architecture = getattr(transformers, hf.ARCHITECTURES[0])
    model = architecture(architecture.config_class(**config, attn_implementation="eager"))
    names = hf.to_hf({name: name for name in initial})  # HF name -> mindlab name (a tied alias -> its source)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.to_hf(initial).items()}, strict=True)
    return model.float().train(), names


def _clm_loss(model, input_ids, labels, ignore_index: int):
    """Rows of seq_len + 1 tokens: predict each next token, mean over the labels that count."""
    from torch.nn.functional import cross_entropy

    logits = model(input_ids[:, :-1]).logits
    labels = labels[:, 1:].reshape(-1)
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, ignore_index=ignore_index), \
        int((labels != ignore_index).sum())


def _mlm_loss(model, input_ids, token_type_ids, attention_mask, labels, *sentence, ignore_index: int = -100):
    """The masked-LM mean plus the sentence task's mean over rows (BertForPreTraining's two heads)."""
    from torch.nn.functional import cross_entropy

    out = model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    loss = cross_entropy(out.prediction_logits.reshape(-1, out.prediction_logits.shape[-1]), labels.reshape(-1))
    if sentence:
        loss = loss + cross_entropy(out.seq_relationship_logits, sentence[0])
    return loss, int((labels != ignore_index).sum())


# objective.name -> its loss in PyTorch, on the objective's own inputs (the objectives this check covers)
TORCH_LOSSES = {"clm": lambda model, inputs, o: _clm_loss(model, *inputs, ignore_index=o.ignore_index),
                "mlm": lambda model, inputs, o: _mlm_loss(model, *inputs)}


def torch_loss(cfg, model, inputs: tuple):
    """(the micro-batch's loss: a mean over its loss tokens, as mindlab's loss cell; how many there are)."""
    import torch

    return TORCH_LOSSES[cfg.objective.name](model, [torch.from_numpy(x.astype(np.int64)) for x in inputs],
                                            cfg.objective)


def torch_run(cfg, initial: dict, batches: List[List[tuple]]) -> List[float]:
    """The same steps in PyTorch: the Hugging Face model + torch.optim.AdamW over the same decay groups, the
    same schedule and global-norm clipping; micro-batches weighted by their share of the step's loss tokens."""
    import torch

    from trainer.optimizer import decays

    torch.manual_seed(0)
    model, names = torch_model(cfg, initial)
    params = dict(model.named_parameters())
    o = cfg.optim
    groups = [{"params": [p for n, p in params.items() if decays(names[n], o)], "weight_decay": o.weight_decay},
              {"params": [p for n, p in params.items() if not decays(names[n], o)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses = []
    for update, micro in enumerate(batches):
        outs = [torch_loss(cfg, model, inputs) for inputs in micro]  # (graphs kept until backward: small models)
        total = sum(n for _, n in outs)
        for loss, n in outs:
            (loss * n / total).backward()
        if o.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad_norm)
        for group in opt.param_groups:
            group["lr"] = reference_lr(o, update, cfg.trainer.max_steps)
        opt.step()
        opt.zero_grad()
        losses.append(sum(loss.item() * n / total for loss, n in outs))
    return losses


def compare(overrides: List[str], steps: int, family: str = "llama", floor: bool = False) -> List[tuple]:
    """(step, mindlab loss, PyTorch loss, relative difference[, PyTorch's own: from weights one ulp away]) for
    `steps` steps of train.py's config with DEFAULTS[family] and `overrides`. The last column is the fp32 noise
    floor: how far PyTorch drifts from itself for rounding reasons alone."""
    from hydra import compose, initialize_config_dir

    from base.schema import REPO_ROOT
    from plugins import register
    from base.validate import validate

    register()
    with initialize_config_dir(os.path.join(REPO_ROOT, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*DEFAULTS[family], f"trainer.max_steps={steps}", *overrides])
    validate(cfg)
    initial, batches, ours = mindlab_run(cfg, steps)
    theirs = torch_run(cfg, initial, batches)
    rows = [(i + 1, a, b, abs(a - b) / abs(b)) for i, (a, b) in enumerate(zip(ours, theirs))]
    if not floor:
        return rows
    nudged = torch_run(cfg, {k: np.nextafter(v, np.float32(np.inf)) for k, v in initial.items()}, batches)
    return [row + (abs(c - row[2]) / abs(row[2]),) for row, c in zip(rows, nudged)]


def verdict(rows) -> List[str]:
    """The criteria each failing row breaks (empty: all pass)."""
    early = [f"step {r[0]}: rel diff {r[3]:.2e} > {EARLY_TOL:g}" for r in rows if r[0] <= FIRST_STEPS and r[3] > EARLY_TOL]
    return early + [f"step {r[0]}: rel diff {r[3]:.2e} > {LATE_TOL:g}" for r in rows if r[0] >= LATE_STEP and r[3] > LATE_TOL]


def main() -> None:
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    args = sys.argv[1:]
    family = args.pop(0) if args and args[0] in DEFAULTS else "llama"
    steps = next((int(a.split("=")[1]) for a in args if a.startswith("steps=")), 120)
    floor = "floor" in args  # also PyTorch against itself from weights one ulp away
    overrides = [a for a in args if not a.startswith("steps=") and a != "floor"]
    rows = compare(overrides, steps, family, floor)
    print(f"{family}: {' '.join(DEFAULTS[family] + overrides)}, {steps} steps, fp32 CPU")
    print(f"{'step':>5} {'mindlab loss':>13} {'PyTorch loss':>13} {'rel diff':>10}" +
          (f" {'PyTorch vs PyTorch 1 ulp':>25}" if floor else ""))
    for row in rows:
        if row[0] <= FIRST_STEPS or row[0] % 10 == 0:
            print(f"{row[0]:>5} {row[1]:>13.7f} {row[2]:>13.7f} {row[3]:>10.2e}" + (f" {row[4]:>25.2e}" if floor else ""))
    early = max(row[3] for row in rows if row[0] <= FIRST_STEPS)
    late = max((row[3] for row in rows if row[0] >= LATE_STEP), default=float("nan"))
    failures = verdict(rows)
    print(f"max rel diff: steps 1-{FIRST_STEPS} {early:.2e} (<= {EARLY_TOL:g}), steps >= {LATE_STEP} {late:.2e} "
          f"(<= {LATE_TOL:g}): {'PASS' if not failures else f'FAIL ({len(failures)} steps)'}")


if __name__ == "__main__":
    main()
