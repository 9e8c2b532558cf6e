"""A recipe end to end, as a user runs it: `python -m recipe recipe=tiny_chat` (pretrain -> SFT -> DPO ->
evaluate), then a sweep of two variants that differ in the last training stage, whose shared stages run once.
Printed per stage: ran or reused, its seconds and its final numbers; then the wall time of each command.

    scripts/venv.sh python -m benchmarks.recipe_chain [--recipe tiny_chat]
        [--sweep recipe.stages.dpo.objective.beta=0.05,0.2] [--workdir DIR] [recipe overrides ...]

The datasets the recipe names are built first when missing (their time is in the first command's wall time).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import recorded
from sweeps.recipe_report import variants

SHOWN = ("val_loss", "val_bpb", "val_mean_token_accuracy", "val_rewards/accuracies", "val_rewards/margins", "loss",
         "bits_per_byte")  # of each stage's final numbers, those it has


def run(argv: list, workdir: str, name: str) -> float:
    """`python -m recipe argv` with its output in <workdir>/<name>.log; its wall seconds."""
    start = time.perf_counter()
    with open(os.path.join(workdir, f"{name}.log"), "w", encoding="utf-8") as log:
        code = subprocess.call([sys.executable, "-m", "recipe", *argv], stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"python -m recipe {' '.join(argv)} exited with {code}; its log: {log.name}")
    return time.perf_counter() - start


def stage_rows(variant: dict, swept: str) -> list:
    """A row per stage of a recipe run (sweeps/recipe_report.py's load_variant), named by its value of the swept key
    (or the recipe's own)."""
    name = next((o for o in variant["variant"].split(",") if o.startswith(swept + "=")), "as the recipe says")
    rows = []
    for stage in variant["stages"]:
        shown = ", ".join(f"{k} {stage['metrics'][k]:.4f}" for k in SHOWN if k in stage["metrics"])
        rows.append(f"| {name} | {stage['link']} | {stage['state']} | {stage['seconds']:.0f} | {shown} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_chat")
    parser.add_argument("--sweep", default="recipe.stages.dpo.objective.beta=0.05,0.2",
                        help="the sweep's one swept key (its variants share the stages before that stage)")
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory)")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        chain, sweep = work / "chain", work / "sweep"
        one = run([f"recipe={args.recipe}", *overrides, f"hydra.run.dir={chain}"], str(work), "chain")
        many = run(["-m", f"recipe={args.recipe}", args.sweep, *overrides, f"hydra.sweep.dir={sweep}"], str(work),
                   "sweep")
        print(f"{' '.join([f'recipe={args.recipe}', *overrides])}; the sweep: {args.sweep}")
        print()
        print("| variant | stage | state | s | final numbers |")
        print("|---|---|---|---:|---|")
        for variant in variants(chain) + variants(sweep):
            print("\n".join(stage_rows(variant, args.sweep.split("=", 1)[0])))
        print()
        print(f"python -m recipe recipe={args.recipe}: {one / 60:.1f} min wall (datasets built when missing included)")
        print(f"python -m recipe -m ... {args.sweep}: {many / 60:.1f} min wall for "
              f"{len(args.sweep.split('=', 1)[1].split(','))} variants; load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    with recorded("benchmarks.recipe_chain", "A recipe end to end, and a sweep of it that shares stages"):
        main()
