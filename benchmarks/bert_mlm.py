"""BERT masked-LM pretraining, measured: `stage=bert_tiny_mlm` on data=wiki, its validation MLM accuracy
curve next to the unigram baseline (always predicting the training text's most frequent token), NSP accuracy,
tokens/s and peak RSS.

    scripts/venv.sh python -m benchmarks.bert_mlm [trainer.max_steps=600] [model=bert_small] ...

The baseline: masked positions are drawn uniformly over non-special tokens, so predicting the most frequent
non-special token of the training split is right at that token's share of the validation split's
non-special tokens.
"""
import json
import os
import sys
import tempfile

import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import numpy as np
from hydra import compose, initialize_config_dir

from benchmarks.measure import train_and_measure
from base.schema import REPO_ROOT
from plugins import register
from benchmarks.results import recorded

DEFAULTS = ["stage=bert_tiny_mlm", "logger.progress_bar=false"]


def unigram_baseline(cfg) -> float:
    from data.cache import prepare
    from objectives.mlm import SPECIAL_PIECES, row_spec

    prepared = prepare(cfg.data, row_spec(cfg.objective))
    tok = prepared.tokenizer()
    special = {tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id, *(tok.piece_id(p) for p in SPECIAL_PIECES)}
    counts = {split: sum(np.bincount(prepared.tokens(s, split), minlength=tok.vocab_size) for s in prepared.sources)
              for split in ("train", "val")}
    for split in counts:
        counts[split][sorted(special)] = 0
    top = int(np.argmax(counts["train"]))
    print(f"most frequent training token: {tok.sp.id_to_piece(top)!r} (id {top})")
    return float(counts["val"][top] / counts["val"].sum())


def main() -> None:
    overrides = [*DEFAULTS, *sys.argv[1:]]
    register()
    with initialize_config_dir(f"{REPO_ROOT}/conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    baseline = unigram_baseline(cfg)
    with tempfile.TemporaryDirectory() as workdir:
        result = train_and_measure("bert", overrides, workdir)
        lines = [json.loads(line) for line in open(os.path.join(workdir, "bert", "metrics.jsonl"))]
    print(f"overrides: {' '.join(overrides)}")
    print(f"{'step':>6} {'val MLM acc':>12} {'unigram':>8} {'val MLM loss':>13} {'val NSP acc':>12}")
    for m in (m for m in lines if "val_loss" in m):
        print(f"{m['step']:>6} {m['val_mlm_accuracy']:>12.4f} {baseline:>8.4f} {m['val_mlm_loss']:>13.4f} "
              f"{m['val_nsp_accuracy']:>12.4f}")
    print(f"tokens/s {result['tokens_per_sec']:.0f}, MFU {result['mfu']:.2%}, peak RSS {result['peak_rss_gb']:.2f} GiB, "
          f"final train loss {result['final_loss']:.4f}")


if __name__ == "__main__":
    with recorded("benchmarks.bert_mlm", "BERT masked-LM pretraining: fill-mask accuracy against the unigram baseline"):
        main()
