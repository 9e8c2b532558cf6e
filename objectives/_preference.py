"""Rows of preference pairs, what the reward model (objectives/rm.py) and DPO (objectives/dpo.py) train on.

Stage 1 (data/samples.py, kind `preference`) writes each pair as two samples, chosen then rejected, and its
margin. A row here is one pair, each side padded on the right to seq_len + 1 tokens:

    chosen_ids, rejected_ids        int32 [seq_len + 1]: prompt, response, eos, then pad
    chosen_labels, rejected_labels  int32 [seq_len + 1]: the token where it carries loss (the response, the
                                    template's end text and the eos), -100 on the prompt and the padding
    margin                          float32 [1]: how much better chosen is (0 unless the data says)

Pairs are never packed: both sides of a row start at position 0 and the causal mask alone keeps the padding
out (it comes last). Each side holds at most seq_len tokens, so the last column is always padding and a
model fed ids[:, :-1] sees every real token, the eos included (the reward model reads its hidden state there).
"""
from __future__ import annotations

from functools import partial
from typing import Iterator

import numpy as np

from base.errors import require
from base.schema import is_sharded
from data.errors import DataError
from data.rows import RowSpec, Split
from objectives.sft import IGNORE_INDEX

SIDES = ("chosen", "rejected")
DATA_HINT = "use data=preferences or your own pairs (docs/alignment.md: Your own pairs)"
COLUMNS = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels", "margin")


def require_data_parallel(cfg, objective: str, why: str) -> None:
    """Refused, not planned: the tensor/pipeline plan (models/<family>/plan.py) lays out the language model's own
    cells, and what a pair objective adds (`why`: a score head, a reference model) is not among them; nothing
    sharded runs here to check a plan of it against."""
    require(not is_sharded(cfg.parallel), "parallel", f"objective={objective} trains data parallel only "
            f"(parallel={cfg.parallel.name}: {why}); use parallel=single, or dp alone "
            "(e.g. parallel=dp8 parallel.optimizer_shard=false)")


def pair_schema(seq_len: int) -> dict:
    return {**{name: {"type": "int32", "shape": [seq_len + 1]} for name in COLUMNS[:-1]},
            "margin": {"type": "float32", "shape": [1]}}


def pair_rows(skip_long: bool, split: Split, seq_len: int, tokenizer) -> Iterator[dict]:
    """One row per pair (see the module docstring); a side longer than seq_len tokens is an error, or with
    `skip_long` its pair is left out (counted in the printed summary)."""
    if split.margin is None:
        raise DataError(f"{split.where}: holds {'documents' if split.loss_mask is None else 'instruction samples'}, "
                        f"not preference pairs; the reward model and DPO train on sources of kind preference "
                        f"(data=preferences, or your own {{prompt, chosen, rejected}} JSONL)")
    offsets, size = split.offsets, seq_len + 1
    tokens, mask = np.asarray(split.tokens), np.asarray(split.loss_mask)
    kept = 0
    for i, margin in enumerate(split.margin):
        spans = [(int(offsets[2 * i + k]), int(offsets[2 * i + k + 1])) for k in (0, 1)]
        longest = max(b - a for a, b in spans)
        if longest > seq_len:
            if skip_long:
                continue
            raise DataError(f"{split.where}: pair {i + 1} has a side of {longest} tokens, more than data.seq_len = "
                            f"{seq_len}; raise data.seq_len, or set objective.skip_long=true to leave such pairs out")
        row = {"margin": np.array([margin], np.float32)}
        for side, (a, b) in zip(SIDES, spans):
            ids = np.full(size, tokenizer.pad_id, np.int32)
            labels = np.full(size, IGNORE_INDEX, np.int32)
            ids[:b - a] = tokens[a:b]
            labels[:b - a] = np.where(mask[a:b] > 0, tokens[a:b], IGNORE_INDEX)
            labels[0] = IGNORE_INDEX  # nothing precedes the first token
            row[f"{side}_ids"], row[f"{side}_labels"] = ids, labels
        kept += 1
        yield row
    print(f"[data] {split.where}: {kept:,} of {len(split.margin):,} pairs in rows of {size} tokens"
          + (f" ({len(split.margin) - kept:,} longer than data.seq_len left out)" if kept < len(split.margin) else ""),
          flush=True)


def pair_row_spec(skip_long: bool) -> RowSpec:
    return RowSpec(name=f"pairs{'-skip-long' if skip_long else ''}", columns=COLUMNS, schema=pair_schema,
                   build=partial(pair_rows, skip_long))


def last_labelled(labels: np.ndarray) -> np.ndarray:
    """[B, S] labels -> [B] index of each row's last token that carries loss (the eos closing the response)."""
    counted = labels != IGNORE_INDEX
    return labels.shape[1] - 1 - np.argmax(counted[:, ::-1], axis=1)
