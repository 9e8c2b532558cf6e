"""The comparison table (runs x varied parameters x results), shared by the HTML page, stdout and W&B."""
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sweeps.runs import Run


@dataclass
class Column:
    title: str
    value: Callable[[Run], Any]  # the exact number (or text) from the run's files; None: not available
    fmt: Callable[[Any], str] = str


def _num(digits: int) -> Callable[[Any], str]:
    return lambda v: f"{v:.{digits}f}"


def _best_val(run: Run) -> Optional[float]:
    return run.best_eval["val_loss"] if run.best_eval else None


def columns(varied: list) -> list:
    return ([Column("run", lambda r: r.name)]
            + [Column(key, lambda r, key=key: r.overrides.get(key)) for key in varied]
            + [Column("status", lambda r: r.status),
               Column("step", lambda r: r.last_step),
               Column("skipped", lambda r: r.skipped),
               Column("tokens seen", lambda r: r.tokens_seen, lambda v: f"{v:,}"),
               Column("final loss", lambda r: r.final_loss, _num(4)),
               Column("final val loss", lambda r: r.final_val_loss, _num(4)),
               Column("best val loss", _best_val, _num(4)),
               Column("best at step", lambda r: r.best_eval["step"] if r.best_eval else None),
               Column("tokens/s", lambda r: r.tokens_per_sec, _num(0)),
               Column("MFU", lambda r: r.mfu, lambda v: f"{v:.2%}"),
               Column("peak RSS GB", lambda r: r.peak_rss_gb, _num(2))])


def cell(column: Column, run: Run) -> str:
    value = column.value(run)
    return "—" if value is None else column.fmt(value)


def markdown(runs: list, varied: list, best: Optional[Run]) -> str:
    """The table as Markdown (stdout, W&B); the best run's name in bold."""
    cols = columns(varied)
    lines = ["| " + " | ".join(c.title for c in cols) + " |", "|" + " --- |" * len(cols)]
    for run in runs:
        cells = [cell(c, run) for c in cols]
        if run is best:
            cells[0] = f"**{cells[0]}** (best)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
