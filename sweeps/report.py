"""`python -m sweeps.report DIR`: compare the runs of a Hydra multirun dir in DIR/report.html (+ its PNGs).

Every job dir under DIR is read (.hydra/overrides.yaml, status.json, config.yaml, metrics.jsonl); runs that
crashed or are still running are listed and marked, never dropped. report.html is self-contained (PNGs
embedded as base64) and opens offline. When the runs logged to W&B online (logger=wandb, WANDB_API_KEY set),
a W&B Report of the sweep's group is created too (needs the `wandb-workspaces` package).
"""
import os
import re
import sys
from typing import Optional

from omegaconf import OmegaConf

from base.errors import ArgumentParser, UsageError, UserError, entry_point
from base.outputs import owned_files
from sweeps import recipe_report
from sweeps import table
from sweeps.page import render
from sweeps.plots import curves, png, val_by_source
from sweeps.runs import Run, best_run, load_sweep, varied_params
from sweeps.wandb_report import create_report, wandb_target


def build(sweep_dir: str, use_wandb: bool = True) -> str:
    """Write report.html and the PNGs into `sweep_dir`; returns report.html's path."""
    if not os.path.isdir(sweep_dir):
        raise UsageError(f"{sweep_dir}: no such directory; give a multirun dir, e.g. multirun/2026-11-30/10-00-00")
    if recipe_report.variants_in(sweep_dir):  # a sweep of recipes (python -m recipe -m): stage by stage
        return str(recipe_report.write(sweep_dir))
    runs = load_sweep(sweep_dir)
    if not runs:
        raise UserError(f"{sweep_dir}: no job dirs (holding .hydra/overrides.yaml) under it; give the multirun dir "
                        f"that `train.py -m` printed")
    varied = varied_params(runs)
    best = best_run(runs)
    figures = [(f"loss curves and final val loss by {key}" if key else "loss curves",
                f"curves_{_slug(key)}.png" if key else "curves.png", png(curves(runs, key, varied, best)))
               for key in varied or [None]]
    by_source = val_by_source(runs, varied, best)
    if by_source:
        figures.append(("final val loss per data source", "val_loss_by_source.png", png(by_source)))
    path = os.path.join(sweep_dir, "report.html")
    # a file of these names that this tool did not write is refused, before anything is written or sent to W&B
    with owned_files(sweep_dir, "sweeps.report", [name for _, name, _ in figures] + ["report.html"]):
        markdown = table.markdown(runs, varied, best)
        print(markdown)
        wandb_url = _wandb_report(sweep_dir, runs, best, markdown) if use_wandb else None
        for _, name, data in figures:
            with open(os.path.join(sweep_dir, name), "wb") as f:
                f.write(data)
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(sweep_dir, runs, varied, best, figures, _command(sweep_dir), wandb_url))
    return path


def _wandb_report(sweep_dir: str, runs: list, best: Optional[Run], markdown: str) -> Optional[str]:
    target = wandb_target(runs)
    if target is None:
        return None
    sources = sorted({s for r in runs for s in r.final_val_by_source})
    description = (f"Best run: {best.name}, final val loss {best.final_val_loss:.4f}." if best
                   else "No run has a val loss yet.")
    try:
        url = create_report(target, f"Sweep {os.path.basename(os.path.abspath(sweep_dir))}", description,
                            markdown, sources)
    except ImportError:
        print("W&B report skipped: `pip install wandb-workspaces==0.4.13` to create one", file=sys.stderr)
        return None
    except Exception as err:  # no server, auth, quota: report.html does not depend on it
        print(f"W&B report failed ({type(err).__name__}: {err}); report.html is written anyway", file=sys.stderr)
        return None
    print(f"W&B report: {url}")
    return url


def _command(sweep_dir: str) -> Optional[str]:
    """The `-m` command line's overrides, from multirun.yaml (the basic sweeper writes it; Optuna does not)."""
    path = os.path.join(sweep_dir, "multirun.yaml")
    return " ".join(OmegaConf.load(path).hydra.overrides.task) if os.path.isfile(path) else None


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_")


@entry_point
def main(argv: Optional[list] = None) -> None:
    parser = ArgumentParser(prog="python -m sweeps.report", description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", help="a multirun dir, e.g. multirun/2026-11-30/10-00-00")
    parser.add_argument("--no-wandb", action="store_true", help="do not create a W&B Report even when online")
    args = parser.parse_args(argv)
    print(f"report: {build(args.sweep_dir, use_wandb=not args.no_wandb)}")


if __name__ == "__main__":
    sys.exit(main())
