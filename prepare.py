"""Prepare a data config's cache without training: `python prepare.py data=corpora_5dom [key=value ...]`
(or `python -m prepare ...`).

Takes the same overrides as train.py (it composes the same config) and builds whichever stage is missing:
cleaned and tokenized documents, then the MindRecord rows for data.seq_len in the objective's row layout
(`objective=mlm` builds BERT's sentence pairs). `train.py` does the same on
demand: every rank calls prepare, the first one builds under a file lock and the others wait for it.
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from base.errors import entry_point
from base.schema import REPO_ROOT
from base.validate import validate
from data.cache import prepare
from objectives import objective
from plugins import register


@entry_point
def main(overrides) -> None:
    register()
    with initialize_config_dir(f"{REPO_ROOT}/conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides or []))
    validate(OmegaConf.merge(cfg, {"dry_run": True}))  # dry_run: the machine's devices do not matter here
    prepared = prepare(cfg.data, objective(cfg.objective.name).row_spec(cfg.objective))
    print(summary(prepared.meta))


def summary(meta: dict) -> str:
    """One line per source: documents read, removed by each cleaning step, kept; tokens and rows per split."""
    steps = list(next(iter(meta["sources"].values()))["removed"])
    head = ["source", "read", *steps, "kept", "train tokens", "train rows", "val tokens", "val rows"]
    lines = [[name, m["docs_read"], *m["removed"].values(), m["docs_kept"], m["train"]["tokens"],
              m["train"]["rows"], m["val"]["tokens"], m["val"]["rows"]] for name, m in meta["sources"].items()]
    widths = [max(len(f"{row[i]:,}" if isinstance(row[i], int) else row[i]) for row in [head] + lines)
              for i in range(len(head))]
    fmt = lambda row: "  ".join((f"{v:,}" if isinstance(v, int) else v).rjust(w) for v, w in zip(row, widths))
    return "\n".join([f"seq_len {meta['seq_len']}, vocab {meta['tokenizer']['vocab_size']}"] + [fmt(head)]
                     + [fmt(row) for row in lines])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
