"""`python -m recipe.report DIR`: the report of a recipe's run directory or of a sweep of them (also
`python -m sweeps.report DIR`), and the Hydra callback that writes a recipe sweep's report when it ends. What the
report holds is sweeps/recipe_report.py."""
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from base.errors import ArgumentParser, UsageError, entry_point
from sweeps.recipe_report import variants_in, write


class SweepReport(Callback):
    """Hydra callback of `python -m recipe -m ...`: the sweep's report.html once every variant has run."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)  # HydraConfig is unset once the jobs end; this config resolves as theirs
        if sweep.is_dir() and variants_in(sweep):
            print(f"[recipe] sweep report: {write(sweep)}")


@entry_point
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m recipe.report",
                            description="the report of a recipe run, or of a sweep of recipe variants")
    parser.add_argument("directory", help="a recipe run directory, or a sweep of them")
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such directory; give a recipe run directory or a sweep of them")
    print(f"report: {write(directory)}")


if __name__ == "__main__":
    sys.exit(main())
