"""DPO's reference modes side by side (objectives/dpo.py): `copy`, a second model run in every step's graph,
against `precomputed`, which scores each pair once with the starting model before step 1 and keeps no reference.
Printed per mode: tokens/s of the steps (after the first logging interval, which holds the compile), peak RSS,
the precompute pass (pairs, seconds), wall time, final loss, and the two modes' largest loss difference.

    scripts/venv.sh python -m benchmarks.dpo_reference --init CKPT [--steps 60] [--train-pairs 1000]
        [--val-pairs 200] [--modes precomputed,copy] [--workdir DIR] [overrides ...]

CKPT: an SFT checkpoint (e.g. benchmarks.alignment's). The pairs are the first N of data=preferences' files
(python -m builders.preferences), so the precompute pass, which scores every training pair, stays short; its
seconds grow linearly with the pairs. Each run is its own train.py process, one after the other.
"""
import argparse
import json
import os
import re
import tempfile

import boot  # noqa: F401  (first: MindSpore before anything that loads protobuf)

from benchmarks.measure import summarize, timed_run, train_command
from benchmarks.results import recorded


def head(src: str, dst: str, n: int) -> str:
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for i, line in enumerate(f):
            if i == n:
                break
            out.write(line)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", required=True, help="the checkpoint DPO starts from (model=tiny unless overridden)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--train-pairs", type=int, default=1000)
    parser.add_argument("--val-pairs", type=int, default=200)
    parser.add_argument("--modes", default="copy,precomputed", help="the reference modes, in the order run "
                        "(alternate the order between repeats: the box's load drifts)")
    parser.add_argument("--workdir")
    args, overrides = parser.parse_known_args()
    data_dir = os.environ.get("MINDLAB_DATA_DIR", os.path.expanduser("~/.cache/mindlab/data"))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        train = head(os.path.join(data_dir, "preferences", "train.jsonl"), os.path.join(workdir, "train.jsonl"),
                     args.train_pairs)
        val = head(os.path.join(data_dir, "preferences", "val.jsonl"), os.path.join(workdir, "val.jsonl"),
                   args.val_pairs)
        common = ["stage=dpo", "model=tiny", f"stage.init_from={args.init}",
                  f"data.sources=[{{name: preferences, kind: preference, paths: [{train}], val_paths: [{val}]}}]",
                  f"data.name=preferences_{args.train_pairs}", f"data.cache_dir={os.path.join(workdir, 'cache')}",
                  f"trainer.max_steps={args.steps}", "trainer.micro_batch_size=8", "trainer.log_every=10",
                  "trainer.eval_batches=4", "trainer.save_every=0", "optim.lr=5e-5", "logger.progress_bar=false"]
        runs = {}
        for mode in args.modes.split(","):
            run_dir = os.path.join(workdir, mode)
            out = timed_run(train_command([*common, f"objective.reference={mode}", *overrides], run_dir), run_dir,
                            workdir)
            log = open(os.path.join(workdir, f"{mode}.log"), encoding="utf-8").read()
            pre = re.search(r"reference log-probabilities of ([\d,]+) pairs precomputed in (\d+) s", log)
            runs[mode] = {**summarize(run_dir), "wall_s": out["wall_s"], "load": out["load"],
                          "losses": [m["loss"] for m in out["logs"]],
                          "precompute": (pre.group(1), int(pre.group(2))) if pre else None}
    print(f"DPO, model=tiny, {args.steps} steps of 8 pairs at data.seq_len 256, {args.train_pairs} training and "
          f"{args.val_pairs} val pairs of data=preferences, from {args.init}")
    print("| reference | tokens/s | peak RSS | precompute pass | wall | final loss | load at start / end |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in runs.items():
        pre = f"{r['precompute'][0]} pairs, {r['precompute'][1]} s" if r["precompute"] else "-"
        print(f"| {mode} | {r['tokens_per_sec']:,.0f} | {r['peak_rss_gb']:.2f} GiB | {pre} | {r['wall_s']:.0f} s | "
              f"{r['losses'][-1]:.6f} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    diff = max(abs(a - b) for a, b in zip(runs["copy"]["losses"], runs["precomputed"]["losses"]))
    print(f"largest difference of the logged losses (means over 10 steps): {diff:.2e}")
    print(json.dumps({m: {k: v for k, v in r.items() if k != "losses"} for m, r in runs.items()}))


if __name__ == "__main__":
    with recorded("benchmarks.dpo_reference", "DPO's reference modes: copy against precomputed"):
        main()
