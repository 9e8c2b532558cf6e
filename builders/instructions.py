r"""An instruction-tuning set derived by rule from ../shared/corpora: `python -m builders.instructions`.

What it measures, plainly: faithful recall of reference text that the corpora contain (dictionary
definitions, man-page lines, stdlib docstrings, Wikipedia leads, Bible verses) and following the answer
format. It does NOT measure human helpfulness, reasoning, safety or open-ended instruction following:
every answer is a span copied from one corpus document (whitespace runs collapsed), so a reply can be
checked exactly against the reference, and nothing here was written or rated by people.

The tasks and how each reads its corpus: builders/corpus_parsers.py; the checks, the caps and the held-out split:
builders/instruction_set.py.

Writes `train.jsonl`, `val.jsonl` and `stats.json` (samples per task and split, what each filter dropped)
to `--out` (default `${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/instructions`), atomically. Reads the
`.jsonl.gz` shards of `--corpora` (default `$MINDLAB_CORPORA`, else `../shared/corpora` beside the
checkout). Pure Python and the standard library: no MindSpore.
"""
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from base.errors import ArgumentParser, entry_point, number
from base.outputs import check_output_dir
from base.paths import corpora_dir
from builders.corpus_parsers import SHARDS
from builders.instruction_set import OWN, TOOL, build, default_out_dir, read_documents, shard_paths, write


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m builders.instructions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpora", type=Path, default=None, help="corpora dir (default: $MINDLAB_CORPORA, "
                        "else ../shared/corpora beside the checkout)")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default: "
                        "${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}/instructions)")
    parser.add_argument("--max-per-task", type=number(int, 1), default=4000)
    parser.add_argument("--seed", type=number(int, 0), default=0)
    parser.add_argument("--val-fraction", type=number(float, 0.0, 1.0, high_open=True), default=0.05)
    args = parser.parse_args(argv)
    start = time.time()
    check_output_dir(args.out or default_out_dir(), TOOL, OWN)  # before the build, not after it
    corpora = args.corpora or corpora_dir()
    paths = shard_paths(corpora)
    train, val, stats = build(read_documents(paths), args.max_per_task, args.seed, args.val_fraction)
    stats["corpora"] = {source: shard for source, shard in SHARDS.items()}
    out = write(args.out or default_out_dir(), train, val, stats)
    width = max(map(len, stats["tasks"]))
    print(f"{'task'.ljust(width)}  {'candidates':>10}  {'eligible':>8}  {'train':>6}  {'val':>5}")
    for task, c in stats["tasks"].items():
        print(f"{task.ljust(width)}  {c['candidates']:>10}  {c['eligible']:>8}  {c['train']:>6}  {c['val']:>5}")
    print(f"{'total'.ljust(width)}  {'':>10}  {'':>8}  {stats['total']['train']:>6}  {stats['total']['val']:>5}")
    print(f"wrote {out}/train.jsonl, val.jsonl, stats.json from {corpora} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
