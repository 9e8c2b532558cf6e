"""The PyTorch side of the speed and memory benchmarks: the same Llama, data, loss and optimizer, eager fp32.

    python -m benchmarks.torch_reference export <dir> [hydra overrides]    # MindSpore process: writes <dir>
    python -m benchmarks.torch_reference train <dir> <sdpa|eager> <run_dir>  # torch only: <run_dir>/metrics.jsonl

`export` composes train.py's config, builds mindlab's data and native model as train.py does, and writes what a
process without MindSpore needs to train the same run: the batches of every step (mindlab's loader, same order),
the initial weights under Hugging Face names (models/llama/hf.py), the Hugging Face config, the decay group,
the lr of every update (MindFormers' warmup-cosine as in parity/step.py) and the model's training
FLOPs per token (models/llama/accounting.py). It also leaves the prepared data in the cache, so the timed runs
that follow find it there.

`train` is transformers' LlamaForCausalLM (attn_implementation sdpa: torch's scaled_dot_product_attention;
eager: matmul, mask, softmax, matmul, the math of mindlab's attention) + torch.optim.AdamW over the same decay
groups + clip_grad_norm_, 2 threads, fp32. It never imports MindSpore, so its peak RSS is PyTorch's own. Each
step appends one metrics.jsonl line in train.py's format (step, loss, tokens_per_sec, peak_rss_gb).
"""
import json
import os
import resource
import sys
import time

import numpy as np


def export(out_dir: str, overrides: list) -> None:
    from benchmarks.measure import compose_config, native_pieces
    from parity.step import reference_lr
    from models import family
    from models.llama import hf
    from trainer.optimizer import decays

    cfg = compose_config(overrides)
    t = cfg.trainer
    data, model, objective = native_pieces(cfg)
    initial = {p.name: p.asnumpy() for p in model.get_parameters()}
    rows = [objective.batch(data.train.next_batch(), 0)[0] for _ in range(t.max_steps)]
    os.makedirs(out_dir, exist_ok=True)
    np.save(os.path.join(out_dir, "batches.npy"), np.stack(rows).astype(np.int64))
    weights = hf.to_hf(initial)
    np.savez(os.path.join(out_dir, "weights.npz"), **weights)
    renamed = {hf._rename(name, hf.HF_NAMES): name for name in initial}
    meta = {"hf_config": hf.hf_config(cfg.model), "ignore_index": cfg.objective.ignore_index,
            "decay": [n for n in weights if decays(renamed[n], cfg.optim)],
            "lr": [reference_lr(cfg.optim, u, t.max_steps) for u in range(t.max_steps)],
            "betas": list(cfg.optim.betas), "eps": cfg.optim.eps, "weight_decay": cfg.optim.weight_decay,
            "clip_grad_norm": cfg.optim.clip_grad_norm,
            "flops_per_token": family(cfg.model.family).flops_per_token(cfg.model, cfg.data.seq_len),
            "tokens_per_step": t.micro_batch_size * cfg.data.seq_len}
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)


def trainer(export_dir: str, attention: str, threads: int = 2):
    """(step(update, rows) -> loss tensor: one forward, backward, clip and AdamW update, the export's meta)."""
    import torch
    from torch.nn.functional import cross_entropy
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with open(os.path.join(export_dir, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    model = LlamaForCausalLM(LlamaConfig(**meta["hf_config"], attn_implementation=attention))
    with np.load(os.path.join(export_dir, "weights.npz")) as w:
        model.load_state_dict({k: torch.from_numpy(w[k]) for k in w.files}, strict=True)
    model = model.float().train()
    params = dict(model.named_parameters())
    decay = set(meta["decay"])
    opt = torch.optim.AdamW([{"params": [p for n, p in params.items() if n in decay], "weight_decay": meta["weight_decay"]},
                             {"params": [p for n, p in params.items() if n not in decay], "weight_decay": 0.0}],
                            lr=meta["lr"][0], betas=tuple(meta["betas"]), eps=meta["eps"])
    ignore = meta["ignore_index"]

    def step(update: int, rows):
        logits = model(rows[:, :-1]).logits
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), ignore_index=ignore)
        loss.backward()
        if meta["clip_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), meta["clip_grad_norm"])
        for group in opt.param_groups:
            group["lr"] = meta["lr"][update]
        opt.step()
        opt.zero_grad()
        return loss

    return step, meta


def batches(export_dir: str):
    import torch

    return torch.from_numpy(np.load(os.path.join(export_dir, "batches.npy")))


def train(export_dir: str, attention: str, run_dir: str) -> None:
    step, meta = trainer(export_dir, attention)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as out:
        start = time.perf_counter()
        for update, rows in enumerate(batches(export_dir)):
            loss = step(update, rows).item()
            now = time.perf_counter()
            out.write(json.dumps({"step": update + 1, "loss": loss, "tokens_per_sec": meta["tokens_per_step"] / (now - start),
                                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}) + "\n")
            out.flush()
            start = now

if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(sys.argv[2], sys.argv[3:])
    else:
        train(*sys.argv[2:5])
