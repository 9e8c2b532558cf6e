"""Report figures on matplotlib's Agg canvas (no display): curves per varied parameter, per-source val loss."""
import io
from typing import Optional

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sweeps.runs import Run

LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def is_number(value: Optional[str]) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def ordered_values(runs: list, key: str) -> list:
    """The distinct values of override `key`: numerically sorted if all are numbers, else as first seen."""
    values = list(dict.fromkeys(r.overrides.get(key) for r in runs))
    return sorted(values, key=float) if all(map(is_number, values)) else values


def label(run: Run, varied: list, best: Optional[Run]) -> str:
    """The run's varied values, then `(best)` or its status when it did not finish."""
    text = ", ".join(f"{k}={run.overrides.get(k, '—')}" for k in varied) or run.name
    return text + (" (best)" if run is best else f" [{run.status}]" if run.status != "finished" else "")


def curves(runs: list, key: Optional[str], varied: list, best: Optional[Run]) -> Figure:
    """Train and val loss against tokens seen, and final val loss against the value of `key`.

    Colour: the run's value of `key` (key=None, nothing varied: one colour per run); line style and marker:
    its values of the other varied keys. The best run is drawn thicker and starred.
    """
    def value(run: Run) -> Optional[str]:
        return run.overrides.get(key) if key else run.name

    values = ordered_values(runs, key) if key else [r.name for r in runs]
    others = [k for k in varied if k != key]
    groups = list(dict.fromkeys(tuple(r.overrides.get(k) for k in others) for r in runs))
    colours = {v: matplotlib.colormaps["viridis"](0.9 * i / max(len(values) - 1, 1)) for i, v in enumerate(values)}

    def group(run: Run) -> int:
        return groups.index(tuple(run.overrides.get(k) for k in others))

    fig = Figure(figsize=(16, 4.6))
    ax_loss, ax_val, ax_final = fig.subplots(1, 3)
    for run in runs:
        style = dict(color=colours[value(run)], linestyle=LINESTYLES[group(run) % len(LINESTYLES)],
                     linewidth=2.8 if run is best else 1.4, label=label(run, varied, best))
        if run.train:
            ax_loss.plot([m["tokens_seen"] for m in run.train], [m["loss"] for m in run.train], marker=".", **style)
        if run.evals and run.tokens_per_step:
            ax_val.plot([m["step"] * run.tokens_per_step for m in run.evals], [m["val_loss"] for m in run.evals],
                        marker="o", markersize=3, **style)
    for ax, title in [(ax_loss, "train loss"), (ax_val, "val loss")]:
        ax.set(xlabel="tokens seen", ylabel=title, title=f"{title} vs tokens" + (f", by {key}" if key else ""))
        ax.grid(alpha=0.3)
    handles = {line.get_label(): line for line in ax_loss.lines + ax_val.lines}  # one entry per run
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(len(handles), 3), fontsize=8)

    numeric = key is not None and all(map(is_number, values))
    for index, group_values in enumerate(groups):
        members = sorted((r for r in runs if group(r) == index and r.final_val_loss is not None),
                         key=lambda r: values.index(value(r)))
        xs = [float(value(r)) if numeric else values.index(value(r)) for r in members]
        ax_final.plot(xs, [r.final_val_loss for r in members], marker=MARKERS[index % len(MARKERS)],
                      linestyle=LINESTYLES[index % len(LINESTYLES)], color="tab:blue",
                      label=", ".join(f"{k}={v}" for k, v in zip(others, group_values)) or None)
        for x, run in zip(xs, members):
            if run is best:
                ax_final.plot([x], [run.final_val_loss], marker="*", markersize=16, color="crimson", linestyle="none")
            elif run.status != "finished":
                ax_final.annotate(run.status, (x, run.final_val_loss), fontsize=8, color="crimson")
    if numeric and min(map(float, values)) > 0 and max(map(float, values)) >= 10 * min(map(float, values)):
        ax_final.set_xscale("log")
        ax_final.minorticks_off()
    ax_final.set_xticks([float(v) for v in values] if numeric else range(len(values)),
                        [f"{float(v):.3g}" if numeric else str(v) for v in values], rotation=20, fontsize=8)
    ax_final.set(xlabel=key or "run", ylabel="final val loss", title="final val loss (★ best run)")
    ax_final.grid(alpha=0.3)
    if others:
        ax_final.legend(fontsize=7)
    fig.tight_layout()
    return fig


def val_by_source(runs: list, varied: list, best: Optional[Run]) -> Optional[Figure]:
    """Grouped bars of the final val loss per data source, one bar per run; None with fewer than 2 sources."""
    scored = [r for r in runs if r.final_val_by_source]
    sources = sorted({s for r in scored for s in r.final_val_by_source})
    if len(sources) < 2:
        return None
    fig = Figure(figsize=(max(8.0, 0.35 * len(sources) * len(scored)), 4.6))
    ax = fig.subplots()
    width = 0.8 / len(scored)
    for i, run in enumerate(scored):
        xs = [j + (i - (len(scored) - 1) / 2) * width for j in range(len(sources))]
        ax.bar(xs, [run.final_val_by_source.get(s, float("nan")) for s in sources], width,
               label=label(run, varied, best),
               edgecolor="crimson", linewidth=2 if run is best else 0)
    losses = [v for r in scored for v in r.final_val_by_source.values()]
    pad = max(0.1 * (max(losses) - min(losses)), 0.01)
    ax.set_ylim(min(losses) - pad, max(losses) + pad)  # the differences, not the distance from zero
    ax.set_xticks(range(len(sources)), sources)
    ax.set(ylabel="final val loss", title="final val loss per data source")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
