"""The per-source evaluation of a checkpoint over its validation batches:

  loss, metrics  the objective's loss cell, token-weighted (evaluation/validation.py: training's val_loss code;
                 the objective's loss alone, without a MoE router's auxiliary loss)
  with the objective's `token_nll` hook (a causal LM):
    ppl, bits_per_byte, tokens, bytes   from the per-token NLLs of the counted targets (labels >= 0)
    unigram        the add-one smoothed unigram baseline of the source's training split, same targets
    by position    mean NLL per bucket of target positions, at data.seq_len and at each eval.context_lengths
                   entry (the rows re-packed at that length: only the packing is redone)
  with the objective's `fill_mask` hook (a masked LM):
    top1 / top5 accuracy over the masked tokens (masked by the objective as in training, seeded by
    trainer.seed), next to the unigram baseline's (always the most frequent non-special training token)
"""
import math
import time
from typing import Dict

import numpy as np
from omegaconf import DictConfig, OmegaConf

from evaluation.bpb import bits_per_byte, dummy_prefix_pieces, piece_bytes, target_bytes, unigram_nll
from evaluation.position import loss_by_position
from evaluation.scorer import token_nll
from evaluation.validation import batch_means, lm_loss_only, val_metrics

FILL_MASK_K = 5  # fill-mask accuracy is reported at top-1 and top-FILL_MASK_K


def evaluate_sources(cfg: DictConfig, eval_cfg, model, objective, log=print) -> dict:
    """Per-source results over the validation batches (see the module docstring)."""
    from base.registry import OBJECTIVES
    from data import build_data
    from data.cache import prepare

    spec = OBJECTIVES[cfg.objective.name].row_spec(cfg.objective)
    mbs = cfg.trainer.micro_batch_size
    n_batches = eval_cfg.batches if eval_cfg.batches is not None else cfg.trainer.eval_batches
    n_batches = n_batches or 1 << 40  # 0: every validation row
    data = build_data(cfg.data, mbs, seed=cfg.trainer.seed, eval_batches=n_batches, spec=spec)
    val = {source: [objective.batch(b, -1 - i) for i, b in enumerate(batches)] for source, batches in data.val.items()}
    start = time.perf_counter()
    loss_net = lm_loss_only(objective.loss_cell(model))  # training's val_loss: the objective's loss alone
    trained_code = val_metrics({source: batch_means(loss_net, objective, batches)
                                for source, batches in val.items() if batches}, objective.metrics)
    log(f"[eval] loss cell over {sum(map(len, val.values()))} batches in {time.perf_counter() - start:.1f}s")
    out = {"sources": {}, "objective": cfg.objective.name, "batches_per_source": {s: len(b) for s, b in val.items()},
           "micro_batch_size": mbs}
    metrics = ("loss",) + tuple(objective.metrics)
    for source in val:
        out["sources"][source] = {m: trained_code[f"val_{m}/{source}"] for m in metrics}
    out["all"] = {m: trained_code[f"val_{m}"] for m in metrics}
    prepared = prepare(cfg.data, spec)
    if objective.token_nll is not None:  # (a masked LM's loss may add a sentence task's: its exp is no perplexity)
        for r in list(out["sources"].values()) + [out["all"]]:
            r["ppl"] = math.exp(min(r["loss"], 50.0))
        _token_nll(out, cfg, eval_cfg, model, objective, data.tokenizer, val, prepared, spec, n_batches, log)
    if objective.fill_mask is not None:
        _fill_mask(out, model, objective, data.tokenizer, val, prepared)
    return out


def _nll(cell, batches) -> tuple:
    """(per-token NLL [N, S], counted float [N, S]) of the objective's inputs (input_ids, labels, ...): the targets
    labels[:, 1:] that carry loss (>= 0)."""
    nll = token_nll(cell, [inputs[0] for inputs in batches])
    counted = (np.concatenate([inputs[1] for inputs in batches])[:, 1:] >= 0).astype(np.float64)
    return nll, counted


def _token_nll(out: dict, cfg, eval_cfg, model, objective, tokenizer, val, prepared, spec, n_batches: int,
               log) -> None:
    """Bits per byte, the unigram baseline and loss by position, from the objective's per-token NLL (`spec` and
    `n_batches`: the rows re-packed at each eval.context_lengths entry)."""
    from models import set_context_length

    table, prefix = piece_bytes(tokenizer), dummy_prefix_pieces(tokenizer)
    cell = objective.token_nll(model)
    totals = {"nats": 0.0, "bytes": 0, "tokens": 0, "unigram_nats": 0.0}
    nll_all, counted_all = [], []
    start = time.perf_counter()
    for source, batches in val.items():
        nll, counted = _nll(cell, batches)
        ids = np.concatenate([inputs[0] for inputs in batches])
        labels = np.concatenate([inputs[1] for inputs in batches])
        n_bytes = target_bytes(ids, table, tokenizer.eos_id, prefix, labels)
        targets = np.where(counted > 0, labels[:, 1:], 0)
        uni = unigram_nll(prepared.tokens(source, "train"), targets, tokenizer.vocab_size) * counted
        n, nats = int(counted.sum()), float((nll * counted).sum())
        r = out["sources"][source]
        r.update({"rows": int(ids.shape[0]), "tokens": n, "bytes": int(n_bytes.sum()), "token_nll_mean": nats / n,
                  "bits_per_byte": bits_per_byte(nats, n_bytes.sum()), "unigram_loss": float(uni.sum()) / n,
                  "unigram_bits_per_byte": bits_per_byte(uni.sum(), n_bytes.sum()),
                  "by_position": loss_by_position(nll, eval_cfg.position_bucket, counted)})
        if abs(r["token_nll_mean"] - r["loss"]) > 1e-3 * max(1.0, abs(r["loss"])):
            log(f"[eval] warning: {source}: per-token NLL mean {r['token_nll_mean']:.5f} differs from the loss "
                f"cell's {r['loss']:.5f}")
        totals["nats"] += nats
        totals["bytes"] += int(n_bytes.sum())
        totals["tokens"] += n
        totals["unigram_nats"] += float(uni.sum())
        nll_all.append(nll)
        counted_all.append(counted)
    log(f"[eval] per-token NLL over {totals['tokens']:,} tokens in {time.perf_counter() - start:.1f}s")
    out["all"].update({"tokens": totals["tokens"], "bytes": totals["bytes"],
                       "bits_per_byte": bits_per_byte(totals["nats"], totals["bytes"]),
                       "unigram_loss": totals["unigram_nats"] / totals["tokens"],
                       "unigram_bits_per_byte": bits_per_byte(totals["unigram_nats"], totals["bytes"])})
    seq_len = cfg.data.seq_len
    by_length: Dict[int, dict] = {seq_len: {
        "all": loss_by_position(np.concatenate(nll_all), eval_cfg.position_bucket, np.concatenate(counted_all)),
        "rows": int(sum(len(n) for n in nll_all))}}
    for length in eval_cfg.context_lengths:  # (in the model's window: evaluation/run.py checked them)
        if length == seq_len:
            continue
        data_l = OmegaConf.merge(cfg, {"data": {"seq_len": int(length)}}).data  # (interpolations resolve)
        from data import DataError
        from data.cache import prepare
        from data.loader import validation_batches

        try:
            batches = validation_batches(prepare(data_l, spec), cfg.trainer.micro_batch_size, n_batches)
        except DataError as err:
            by_length[int(length)] = {"skipped": str(err)}
            log(f"[eval] context length {length}: skipped ({err})")
            continue
        start = time.perf_counter()
        set_context_length(cfg.model.family, model, length)
        scored = [_nll(cell, [objective.batch(b, -1 - i) for i, b in enumerate(bs)]) for bs in batches.values()]
        nll, counted = np.concatenate([s[0] for s in scored]), np.concatenate([s[1] for s in scored])
        by_length[int(length)] = {"all": loss_by_position(nll, eval_cfg.position_bucket, counted),
                                  "rows": int(len(nll)), "loss": float((nll * counted).sum()) / int(counted.sum())}
        log(f"[eval] context length {length}: {len(nll)} rows in {time.perf_counter() - start:.1f}s")
    by_length[seq_len]["loss"] = totals["nats"] / totals["tokens"]
    out["context_lengths"] = {str(k): v for k, v in sorted(by_length.items())}
    out["position_bucket"] = eval_cfg.position_bucket


def fill_mask_counts(topk: np.ndarray, labels: np.ndarray):
    """(masked tokens, top-1 hits, top-k hits) of predictions `topk` [B, S, k] (best first) against `labels`,
    negative where no token was masked."""
    labels = np.asarray(labels)
    masked = labels >= 0
    hit = np.asarray(topk) == labels[..., None]
    return int(masked.sum()), int((hit[..., 0] & masked).sum()), int((hit.any(-1) & masked).sum())


def _fill_mask(out: dict, model, objective, tokenizer, val, prepared) -> None:
    """Fill-mask top-1 / top-k accuracy and the unigram baseline, from the objective's fill-mask cell."""
    from mindspore import Tensor

    cell = objective.fill_mask(model, FILL_MASK_K)
    special = sorted(cell.special_ids)
    totals = np.zeros(3, np.int64)
    uni_nats, uni_hits = 0.0, 0
    for source, batches in val.items():
        counts = np.zeros(3, np.int64)
        train_tokens = prepared.tokens(source, "train")
        freq = np.bincount(np.asarray(train_tokens, np.int64), minlength=tokenizer.vocab_size)
        freq[special] = 0
        top = int(np.argmax(freq))
        masked = []
        for inputs in batches:
            topk, labels = (x.asnumpy() for x in cell(*map(Tensor, inputs)))
            counts += fill_mask_counts(topk, labels)
            masked.append(labels[labels >= 0])
        masked = np.concatenate(masked) if masked else np.zeros(0, np.int64)
        uni = unigram_nll(train_tokens, masked, tokenizer.vocab_size)
        r = out["sources"][source]
        r.update({"masked_tokens": int(counts[0]), "top1_accuracy": counts[1] / max(counts[0], 1),
                  f"top{FILL_MASK_K}_accuracy": counts[2] / max(counts[0], 1), "unigram_loss": float(uni.mean()),
                  "unigram_top1_accuracy": float((masked == top).mean()) if masked.size else float("nan"),
                  "unigram_top1_token": tokenizer.sp.id_to_piece(top)})
        totals += counts
        uni_nats += float(uni.sum())
        uni_hits += int((masked == top).sum())
    out["all"].update({"masked_tokens": int(totals[0]), "top1_accuracy": totals[1] / max(totals[0], 1),
                       f"top{FILL_MASK_K}_accuracy": totals[2] / max(totals[0], 1),
                       "unigram_loss": uni_nats / max(totals[0], 1),
                       "unigram_top1_accuracy": uni_hits / max(totals[0], 1)})
