"""Prepare a data config's cache without training: `python prepare.py data=corpora_5dom [key=value ...]`
(or `python -m prepare ...`).

Takes the same overrides as train.py (it composes the same config) and builds whichever stage is missing:
cleaned and tokenized documents, then the MindRecord rows for data.seq_len in the objective's row layout
(`objective=mlm` builds BERT's sentence pairs). `train.py` does the same on
demand: every rank calls prepare, the first one builds under a file lock and the others wait for it.
A prepare that was killed keeps what it finished; run it again to continue.

Over many machines sharing data.cache_dir (scripts/slurm_prepare.sbatch runs these as Slurm jobs), stage 1
runs step by step, the per-unit steps split into parts (every n-th work unit of ~64 MB of input):
    python prepare.py data=... step=clean part=i/n      # each i in 0..n-1, anywhere, in any order
    python prepare.py data=... step=plan                # once all parts are cleaned: dedup, split, tokenizer
    python prepare.py data=... step=tokenize part=i/n   # each i again
    python prepare.py data=...                          # the merge, then the rows (what is missing is done)
The output is the same bytes as one prepare's, however many parts.
"""
import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

import re
import sys
from typing import List, Optional, Tuple

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from base.errors import ConfigError, entry_point
from base.schema import REPO_ROOT
from base.validate import validate
from data.cache import STEPS, prepare, prepare_step
from objectives import objective
from plugins import register


@entry_point
def main(overrides) -> None:
    register()
    overrides, step, part = fan_out(list(overrides or []))
    with initialize_config_dir(f"{REPO_ROOT}/conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    validate(OmegaConf.merge(cfg, {"dry_run": True}))  # dry_run: the machine's devices do not matter here
    if step:
        print(f"[data] {prepare_step(cfg.data, step, part)}", flush=True)
        return
    prepared = prepare(cfg.data, objective(cfg.objective.name).row_spec(cfg.objective))
    print(summary(prepared.meta))


def fan_out(argv: List[str]) -> Tuple[List[str], Optional[str], Tuple[int, int]]:
    """(the config overrides, step=, part= as (i, n)) from the command line."""
    given = {arg.split("=", 1)[0]: arg.split("=", 1)[1] for arg in argv if arg.startswith(("step=", "part="))}
    rest = [arg for arg in argv if not arg.startswith(("step=", "part="))]
    step, part = given.get("step"), given.get("part")
    if step is not None and step not in STEPS:
        raise ConfigError("step", f"got {step}; choose one of {', '.join(STEPS)} (without step=: everything, "
                                  f"then the merge and the rows)")
    if part is None:
        return rest, step, (0, 1)
    match = re.fullmatch(r"(\d+)/(\d+)", part)
    if not match or not int(match[1]) < int(match[2]):
        raise ConfigError("part", f"got {part}; write it i/n with 0 <= i < n, e.g. part=0/8")
    if step not in ("clean", "tokenize"):
        raise ConfigError("part", "runs one per-unit step of a fan-out: add step=clean or step=tokenize (the "
                                  "plan and the merge cover every part)")
    return rest, step, (int(match[1]), int(match[2]))


def summary(meta: dict) -> str:
    """One line per source: documents read, removed by each cleaning step, kept; tokens and rows per split, and
    the training split's tokens per character of text (what a tokenizer makes of a script: CJK text needs more)."""
    steps = list(next(iter(meta["sources"].values()))["removed"])
    per_char = all("chars" in m["train"] for m in meta["sources"].values())
    head = ["source", "read", *steps, "kept", "train tokens", "train rows", "val tokens", "val rows"] + \
        (["tokens/char"] if per_char else [])
    lines = [[name, m["docs_read"], *m["removed"].values(), m["docs_kept"], m["train"]["tokens"],
              m["train"]["rows"], m["val"]["tokens"], m["val"]["rows"]]
             + ([f"{m['train']['tokens'] / max(m['train']['chars'], 1):.2f}"] if per_char else [])
             for name, m in meta["sources"].items()]
    widths = [max(len(f"{row[i]:,}" if isinstance(row[i], int) else row[i]) for row in [head] + lines)
              for i in range(len(head))]
    fmt = lambda row: "  ".join((f"{v:,}" if isinstance(v, int) else v).rjust(w) for v, w in zip(row, widths))
    return "\n".join([f"seq_len {meta['seq_len']}, vocab {meta['tokenizer']['vocab_size']}"] + [fmt(head)]
                     + [fmt(row) for row in lines])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
