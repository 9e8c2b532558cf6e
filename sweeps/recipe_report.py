"""The report of a recipe run, or of a sweep of recipe variants: every stage's final metrics side by side (the
library behind `python -m recipe.report DIR` and `python -m sweeps.report DIR`, and the recipe sweep's callback).

Per variant (a directory holding recipe.json) and stage: a training stage's last evaluation (val_loss, bits per
byte, per-source losses, the objective's own metrics: SFT's token accuracy, the reward model's and DPO's
preference accuracy and margins) and the objective's logged numbers at its last step (PPO's reward and KL); an
evaluation stage's per-source loss and bits per byte, task scores and its generations for the recipe's prompts.
The variant with the best value of the recipe's `metric` (<stage>/<key>, `goal` max or min) is marked. report.html
is self-contained (curves as embedded PNGs); the table is printed as markdown too.
"""
import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from base.errors import UsageError
from base.outputs import owned_files

RECORD = "recipe.json"
REPORT = "report.html"
CURVES = "curves.png"


def _lines(path: Path) -> List[dict]:
    if not path.is_file():
        return []
    complete = path.read_text(encoding="utf-8").split("\n")[:-1]  # a last line still being written is left out
    return [json.loads(line) for line in complete if line.strip()]


def stage_metrics(kind: str, stage_dir: Path) -> dict:
    """The stage's final numbers, flat: key -> value."""
    if kind == "evaluate":
        out = {}
        path = stage_dir / "eval.json"
        results = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        data = (results.get("data_eval") or {}).get("all") or {}
        out.update({k: v for k, v in data.items() if k in ("loss", "ppl", "bits_per_byte", "top1_accuracy")})
        for task, scores in (results.get("tasks") or {}).items():
            out.update({f"{task}/{k}": v for k, v in scores.items() if k in ("acc", "acc_norm", "exact_match", "rouge_l")})
        return out
    lines = _lines(stage_dir / "metrics.jsonl")
    evals = [m for m in lines if "val_loss" in m]
    train = [m for m in lines if "loss" in m and "skipped" not in m]
    out = {}
    if train:
        last = train[-1]
        out["loss"] = last["loss"]
        out.update({k: v for k, v in last.items() if "/" in k and not k.startswith("tokens_seen/")})
    if evals:
        out.update({k: v for k, v in evals[-1].items() if k.startswith("val_") and k != "val_ppl"})
    return out


def curve(stage_dir: Path) -> List[tuple]:
    return [(m["step"], m["loss"]) for m in _lines(stage_dir / "metrics.jsonl") if "loss" in m and "skipped" not in m]


def load_variant(job_dir: Path) -> dict:
    record = json.loads((job_dir / RECORD).read_text(encoding="utf-8"))
    for stage in record["stages"]:
        where = job_dir / stage["link"]
        stage["metrics"] = stage_metrics(stage["kind"], where)
        stage["curve"] = curve(where) if stage["kind"] == "train" else []
        samples = where / "samples.jsonl"
        stage["samples"] = _lines(samples) if samples.is_file() else []
    record["dir"] = str(job_dir)
    return record


def variants_in(directory) -> bool:
    """Whether `directory` is a recipe run or a sweep of them."""
    directory = Path(directory)
    return (directory / RECORD).is_file() or any((p / RECORD).is_file() for p in directory.iterdir() if p.is_dir())


def variants(directory: Path) -> List[dict]:
    """The recipe runs in `directory`: itself, or its job directories (a sweep), in job order."""
    if (directory / RECORD).is_file():
        return [load_variant(directory)]
    jobs = sorted((p for p in directory.iterdir() if (p / RECORD).is_file()),
                  key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    return [load_variant(p) for p in jobs]


def metric_of(variant: dict, metric: str) -> Optional[float]:
    """`<stage>/<key>` of a variant (None when that stage has no such number yet)."""
    stage, _, key = metric.partition("/")
    for s in variant["stages"]:
        if s["name"] == stage:
            value = s["metrics"].get(key)
            return value if isinstance(value, (int, float)) and not math.isnan(value) else None
    return None


def best(runs: List[dict]) -> Optional[dict]:
    if not runs or not runs[0].get("metric"):
        return None
    metric, goal = runs[0]["metric"], runs[0].get("goal", "max")
    scored = [r for r in runs if metric_of(r, metric) is not None]
    if not scored:
        return None
    pick = max if goal == "max" else min
    return pick(scored, key=lambda r: metric_of(r, metric))


def columns(runs: List[dict]) -> List[tuple]:
    """(stage, key) for every number any variant has, stage by stage, in the recipe's order."""
    out: Dict[tuple, None] = {}
    for r in runs:
        for s in r["stages"]:
            for key in s["metrics"]:
                out[(s["name"], key)] = None
    return list(out)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def markdown(runs: List[dict]) -> str:
    cols = columns(runs)
    winner = best(runs)
    head = ["variant"] + [f"{stage}/{key}" for stage, key in cols]
    rows = []
    for r in runs:
        values = {(s["name"], k): v for s in r["stages"] for k, v in s["metrics"].items()}
        name = r["variant"] + (" (best)" if r is winner else "")
        rows.append([name] + [_fmt(values.get(c)) for c in cols])
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(row) + " |" for row in rows])


def curves_png(runs: List[dict]) -> Optional[bytes]:
    """Training loss against step, one panel per training stage, one line per variant."""
    names = [s["name"] for s in runs[0]["stages"] if s["kind"] == "train"] if runs else []
    if not names:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r in runs:
            points = next((s["curve"] for s in r["stages"] if s["name"] == name), [])
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 20 else None, label=r["variant"])
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=90)
    plt.close(fig)
    return out.getvalue()


def render(runs: List[dict], title: str, png: Optional[bytes]) -> str:
    winner = best(runs)
    cols = columns(runs)
    e = html.escape
    head = "".join(f"<th>{e(stage)}<br>{e(key)}</th>" for stage, key in cols)
    body = []
    for r in runs:
        values = {(s["name"], k): v for s in r["stages"] for k, v in s["metrics"].items()}
        mark = ' class="best"' if r is winner else ""
        stages = " &rarr; ".join(f"{e(s['link'])} ({e(s.get('state', ''))})" for s in r["stages"])
        body.append(f"<tr{mark}><td>{e(r['variant'])}<div class=stages>{stages}</div></td>" +
                    "".join(f"<td>{e(_fmt(values.get(c)))}</td>" for c in cols) + "</tr>")
    parts = [f"<!doctype html><html><head><meta charset=utf-8><meta name=generator content='mindlab recipe.report'>"
             f"<title>{e(title)}</title><style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:"
             "collapse}}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}tr.best{background:#e6f4e6}"
             ".stages{color:#666;font-size:11px}pre{white-space:pre-wrap;background:#f6f6f6;padding:4px}</style>"
             f"</head><body><h1>{e(title)}</h1>"]
    if winner is not None:
        parts.append(f"<p>Best by {e(runs[0]['metric'])} ({e(runs[0].get('goal', 'max'))}): "
                     f"<b>{e(winner['variant'])}</b></p>")
    parts.append(f"<table><tr><th>variant</th>{head}</tr>{''.join(body)}</table>")
    if png:
        parts.append(f"<h2>training loss</h2><img alt='training loss per stage' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    for r in runs:
        for s in r["stages"]:
            if s["samples"]:
                parts.append(f"<h2>generations: {e(r['variant'])}, {e(s['name'])}</h2>")
                for sample in s["samples"]:
                    parts.append(f"<p><b>{e(str(sample.get('instruction', sample.get('prompt', ''))))}</b></p>"
                                 f"<pre>{e(str(sample.get('completion', '')))}</pre>")
    parts.append("</body></html>")
    return "".join(parts)


def write(directory: Path) -> Path:
    """report.html (and curves.png) in `directory` for the recipe run(s) there; the markdown table printed."""
    directory = Path(directory)
    runs = variants(directory)
    if not runs:
        raise UsageError(f"{directory}: holds no recipe run ({RECORD}); give the directory `python -m recipe` wrote")
    print(markdown(runs))
    png = curves_png(runs)
    with owned_files(directory, "recipe.report", [REPORT] + ([CURVES] if png else [])):
        if png:
            (directory / CURVES).write_bytes(png)
        (directory / REPORT).write_text(render(runs, f"recipe {runs[0]['recipe']}: {directory.name}", png),
                                        encoding="utf-8")
    return directory / REPORT
