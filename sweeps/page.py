"""report.html: one self-contained page (inline CSS, PNGs as base64 data URIs) that opens offline."""
import base64
import time
from html import escape
from typing import Optional

from sweeps.runs import Run
from sweeps.table import cell, columns

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f2f2f2; } td.text { text-align: left; }
tr.best td { background: #fff3c4; font-weight: 600; }
.status-finished { color: #1a7f37; } .status-running { color: #9a6700; }
.status-failed, .status-unknown, .status-preempted { color: #cf222e; font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
code { background: #f6f8fa; padding: 1px 4px; }
"""


def render(sweep_dir: str, runs: list, varied: list, best: Optional[Run], figures: list,
           command: Optional[str], wandb_url: Optional[str]) -> str:
    """figures: (caption, file name, PNG bytes) in page order."""
    parts = [f"<h1>Sweep report: {escape(sweep_dir)}</h1>",
             f"<p>{len(runs)} runs; varied: {', '.join(f'<code>{escape(k)}</code>' for k in varied) or 'nothing'}.</p>"]
    if command:
        parts.append(f"<p>Command: <code>python train.py -m {escape(command)}</code></p>")
    if best:
        parts.append(f"<p>Best run: <b>{escape(best.name)}</b> (lowest final val loss, "
                     f"{best.final_val_loss:.4f}), highlighted below.</p>")
    if wandb_url:
        parts.append(f'<p>W&amp;B report: <a href="{escape(wandb_url)}">{escape(wandb_url)}</a></p>')
    parts += ["<h2>Runs</h2>", runs_table(runs, varied, best),
              "<p>tokens/s and MFU: median over the logged intervals after the first (graph compilation).</p>"]
    parts += attention(runs)
    sources = final_table(runs, varied, best, lambda r: r.final_val_by_source, "sources", bold_lowest=True)
    if sources:
        parts += ["<h2>Validation loss per data source</h2>", sources]
    metrics = final_table(runs, varied, best, lambda r: r.final_val_metrics, "metrics", bold_lowest=False)
    if metrics:
        parts += ["<h2>The objective's validation metrics</h2>", metrics]
    parts.append("<h2>Curves</h2>")
    for caption, name, data in figures:
        parts.append(f'<figure><img alt="{escape(caption)}" data-file="{escape(name)}" '
                     f'src="data:image/png;base64,{base64.b64encode(data).decode()}">'
                     f"<figcaption>{escape(caption)}</figcaption></figure>")
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Sweep report</title>'
            f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def runs_table(runs: list, varied: list, best: Optional[Run]) -> str:
    cols = columns(varied)
    head = "".join(f"<th>{escape(c.title)}</th>" for c in cols)
    rows = []
    for run in runs:
        cells = []
        for c in cols:
            value = c.value(run)
            numeric = isinstance(value, (int, float))
            attrs = f' data-value="{value!r}"' if numeric else ' class="text"'
            if c.title == "status":
                attrs = f' class="text status-{escape(run.status)}"'
            cells.append(f"<td{attrs}>{escape(cell(c, run))}</td>")
        row_class = ' class="best"' if run is best else ""
        rows.append(f'<tr{row_class} data-run="{escape(run.name)}">{"".join(cells)}</tr>')
    return f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>\n' + "\n".join(rows) + "\n</tbody></table>"


def attention(runs: list) -> list:
    """Runs that did not finish, each with its status, error and how long ago it last wrote anything."""
    unfinished = [r for r in runs if r.status != "finished"]
    if not unfinished:
        return []
    items = []
    for run in unfinished:
        minutes = (time.time() - run.updated) / 60
        detail = run.error or ("no status.json: it stopped before training started (e.g. a config error; "
                               "see its train.log)" if run.status == "unknown" else "")
        items.append(f'<li data-run="{escape(run.name)}"><b>{escape(run.name)}</b>: '
                     f'<span class="status-{escape(run.status)}">{escape(run.status)}</span>'
                     f"{' — ' + escape(detail) if detail else ''} (last write {minutes:.0f} min ago, "
                     f"step {run.last_step if run.last_step is not None else '—'})</li>")
    return ["<h2>Runs that did not finish</h2>", f'<ul id="unfinished">{"".join(items)}</ul>']


def final_table(runs: list, varied: list, best: Optional[Run], values, table_id: str,
                bold_lowest: bool) -> Optional[str]:
    """One row per run of `values(run)` (name -> number at the last evaluation: the val loss per data source,
    or the objective's metrics), the lowest per column in bold if `bold_lowest`; None when no run has any."""
    scored = [r for r in runs if values(r)]
    names = sorted({s for r in scored for s in values(r)})
    if not names:
        return None
    lowest = {s: min(values(r).get(s, float("inf")) for r in scored) for s in names}
    rows = []
    for run in scored:
        cells = []
        for s in names:
            v = values(run).get(s)
            text = "—" if v is None else f"{v:.4f}"
            bold = bold_lowest and v == lowest[s]
            cells.append(f'<td data-value="{v!r}">{"<b>" + text + "</b>" if bold else text}</td>')
        row_class = ' class="best"' if run is best else ""
        labels = [run.name] + [run.overrides.get(k, "—") for k in varied]
        rows.append(f'<tr{row_class} data-run="{escape(run.name)}">'
                    + "".join(f'<td class="text">{escape(n)}</td>' for n in labels) + "".join(cells) + "</tr>")
    head = "".join(f"<th>{escape(t)}</th>" for t in ["run", *varied, *names])
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>' + "".join(rows) + "</tbody></table>"
