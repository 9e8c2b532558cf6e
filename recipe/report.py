"""The report of a recipe run, or of a sweep of recipe variants: what differs between the variants first.

    python -m recipe.report DIR        # a recipe's run directory or a sweep of them (also: python -m sweeps.report)

A stage every variant shares (the same stage directory: its config and the stages before it are the same) is shown
once; a stage that differs between variants gets a row per variant. The report leads with the recipe's `metric`
(<stage>/<key>, `goal` max or min; the best variant is marked), then each differing stage's held-out numbers (a
training stage's last evaluation: val_loss, bits per byte, per-source losses, the objective's own val_ metrics; an
evaluation stage's loss, bits per byte and task scores), then what those stages logged at their last step (the
training loss, PPO's reward and KL), then the shared stages, then the curves: training and validation loss over
steps, one row per training stage, a shared stage drawn once. No table is wider than the label and
MAX_COLUMNS numbers (a stage with more numbers continues in the next table), so the page fits a laptop screen.
report.html is self-contained (curves as an embedded PNG, CJK text in a CJK font where one is installed); the
tables are printed as markdown too.
"""
import base64
import html
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

from hydra.experimental.callback import Callback

from base.errors import ArgumentParser, UsageError, entry_point
from base.outputs import owned_files
from base.text import CJK

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
        out.update({k: v for k, v in last.items() if "/" in k and not k.startswith(("tokens_seen/", "time"))})
    if evals:
        out.update({k: v for k, v in evals[-1].items() if k.startswith("val_") and k != "val_ppl"})
    return out


def load_variant(job_dir: Path) -> dict:
    record = json.loads((job_dir / RECORD).read_text(encoding="utf-8"))
    for stage in record["stages"]:
        where = job_dir / stage["link"]
        stage["metrics"] = stage_metrics(stage["kind"], where)
        stage["curve"] = curve(where, "loss") if stage["kind"] == "train" else []
        stage["val_curve"] = curve(where, "val_loss") if stage["kind"] == "train" else []
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


MAX_COLUMNS = 8  # numbers per table row: with the label, a table fits a 1366-pixel screen
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Source Han Sans SC", "WenQuanYi Micro Hei", "WenQuanYi Zen Hei",
             "Droid Sans Fallback", "AR PL UMing CN", "PingFang SC", "Microsoft YaHei", "SimHei")


def stage_names(runs: List[dict]) -> List[str]:
    """Every stage any variant has, in the recipe's order."""
    return list(dict.fromkeys(s["name"] for r in runs for s in r["stages"]))


def stage_of(run: dict, name: str) -> Optional[dict]:
    return next((s for s in run["stages"] if s["name"] == name), None)


def shared(runs: List[dict], name: str) -> bool:
    """Whether every variant ran stage `name` as one stage: the same key, so the same directory and numbers."""
    keys = {(stage_of(r, name) or {}).get("key", id(r)) for r in runs}
    return len(keys) == 1


def held_out(stage: dict) -> Dict[str, float]:
    """The stage's numbers on data it did not train on: an evaluation's all, a training stage's val_ keys."""
    return {k: v for k, v in stage["metrics"].items() if stage["kind"] == "evaluate" or k.startswith("val_")}


def last_step(stage: dict) -> Dict[str, float]:
    """What a training stage logged at its last step (the training loss, the objective's numbers)."""
    return {k: v for k, v in stage["metrics"].items() if stage["kind"] == "train" and not k.startswith("val_")}


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


BEST = ' class="best"'


class Table:
    """Rows of a label and numbers under a title, cut into tables of at most MAX_COLUMNS numbers."""

    def __init__(self, title: str, label: str, keys: List[str], rows: List[tuple], mark: Optional[str] = None):
        self.title, self.label, self.keys, self.rows, self.mark = title, label, keys, rows, mark

    def parts(self) -> List[tuple]:
        """(title, keys, [(label, values)]) per table of at most MAX_COLUMNS numbers."""
        out = []
        for start in range(0, max(len(self.keys), 1), MAX_COLUMNS):
            keys = self.keys[start:start + MAX_COLUMNS]
            more = " (continued)" if start else ""
            out.append((self.title + more, keys, [(label, [values.get(k) for k in keys]) for label, values in self.rows]))
        return out

    def markdown(self) -> str:
        text = []
        for title, keys, rows in self.parts():
            text += [f"### {title}", "", "| " + " | ".join([self.label, *keys]) + " |", "|" + "---|" * (len(keys) + 1)]
            text += ["| " + " | ".join([label + (" (best)" if label == self.mark else ""), *map(_fmt, values)]) + " |"
                     for label, values in rows]
            text.append("")
        return "\n".join(text)

    def html(self) -> str:
        e = html.escape
        out = []
        for title, keys, rows in self.parts():
            head = "".join(f"<th>{_breakable(k)}</th>" for k in [self.label, *keys])
            body = "".join(f"<tr{BEST if label == self.mark else ''}><td class=text>{_breakable(label)}</td>" +
                           "".join(f"<td>{e(_fmt(v))}</td>" for v in values) + "</tr>" for label, values in rows)
            out.append(f"<h3>{e(title)}</h3><table><tr>{head}</tr>{body}</table>")
        return "".join(out)


def _breakable(text: str) -> str:
    """`text` escaped, with a line break allowed after each / _ = and a dot before a letter (long metric and
    override names wrap, numbers do not)."""
    return re.sub(r"([/_=]|\.(?=[A-Za-z]))", r"\1<wbr>", html.escape(text))


def _ordered(keys) -> List[str]:
    """The headline numbers first (loss, bits per byte, the objective's own), per-source ones after."""
    keys = list(dict.fromkeys(keys))
    per_source = [k for k in keys if k.split("/")[0] in ("loss", "val_loss", "val_bpb", "val_ppl", "bits_per_byte")
                  and "/" in k]
    return [k for k in keys if k not in per_source] + per_source


EMPTY = {"kind": "", "metrics": {}}  # a stage a variant does not have


def tables(runs: List[dict]) -> List[Table]:
    """The report's tables in page order (see the module docstring)."""
    winner = best(runs)
    mark = winner["variant"] if winner is not None and len(runs) > 1 else None
    names = stage_names(runs)
    differing = [n for n in names if not shared(runs, n)] if len(runs) > 1 else []
    metric = runs[0].get("metric") if runs else None
    lead, _, key = (metric or "").partition("/")
    out = []
    if metric and not (lead in differing and any(key in held_out(stage_of(r, lead) or EMPTY) for r in runs)):
        out.append(Table(f"the recipe's metric ({runs[0].get('goal', 'max')})", "variant", [metric],
                         [(r["variant"], {metric: metric_of(r, metric)}) for r in runs], mark))
    for what, numbers in (("held out", held_out), ("at its last step", last_step)):
        for name in sorted(differing, key=lambda n: n != lead):  # the metric's stage first, its metric first
            rows = [(r["variant"], numbers(stage_of(r, name) or EMPTY)) for r in runs]
            keys = _ordered(k for _, values in rows for k in values)
            title = f"{name}: {what}, per variant"
            if name == lead and key in keys:
                keys = [key] + [k for k in keys if k != key]
                title += f" (first: the recipe's metric, {runs[0].get('goal', 'max')})"
            if keys:
                out.append(Table(title, "variant", keys, rows, mark))
    for name in names:
        if name in differing:
            continue
        stage = next(stage_of(r, name) for r in runs if stage_of(r, name))
        scope = "shared by every variant" if len(runs) > 1 else runs[0]["variant"]
        for what, numbers in (("held out", held_out), ("at its last step", last_step)):
            if numbers(stage):
                out.append(Table(f"{name}: {what}", "stage run by", _ordered(numbers(stage)),
                                 [(scope, numbers(stage))]))
    return out


def markdown(runs: List[dict]) -> str:
    return "\n".join(t.markdown() for t in tables(runs)).rstrip("\n")


def curve(stage_dir: Path, key: str) -> List[tuple]:
    """(step, value) of `key` over the stage's metrics.jsonl: `loss` (training steps) or `val_loss` (evaluations)."""
    return [(m["step"], m[key]) for m in _lines(stage_dir / "metrics.jsonl") if key in m and "skipped" not in m]


def cjk_fonts() -> List[str]:
    """The installed font families of CJK_FONTS (matplotlib falls back through them for characters DejaVu lacks);
    fonts installed after matplotlib cached its font list are added."""
    from matplotlib import font_manager

    known = {f.fname for f in font_manager.fontManager.ttflist}
    for path in font_manager.findSystemFonts():
        if path not in known:
            font_manager.fontManager.addfont(path)
    installed = {f.name for f in font_manager.fontManager.ttflist}
    return [name for name in CJK_FONTS if name in installed]


def has_cjk(text: str) -> bool:
    return re.search(f"[{CJK}]", text) is not None


def curves_png(runs: List[dict]) -> Optional[bytes]:
    """Training and validation loss against step, a row per training stage; a differing stage has a line per
    variant, a shared one a single line."""
    names = [n for n in stage_names(runs) if any((stage_of(r, n) or {}).get("kind") == "train" for r in runs)]
    if not names:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    import matplotlib

    labels = " ".join(r["variant"] for r in runs) + " ".join(names)
    fonts = cjk_fonts()
    if has_cjk(labels) and not fonts:
        print("[recipe] no CJK font installed: Chinese labels in curves.png show as boxes (Debian: apt-get install "
              "fonts-noto-cjk)", file=sys.stderr)
    with matplotlib.rc_context({"font.family": ["DejaVu Sans", *fonts]}):
        fig = Figure(figsize=(12, 2.9 * len(names)))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(names), 2, squeeze=False)
        for (ax_train, ax_val), name in zip(axes, names):
            members = runs[:1] if len(runs) > 1 and shared(runs, name) else runs
            for r in members:
                stage = stage_of(r, name)
                label = "shared by every variant" if members is not runs else r["variant"]
                for ax, points in ((ax_train, stage["curve"]), (ax_val, stage["val_curve"])):
                    if points:
                        ax.plot(*zip(*points), marker="." if len(points) < 20 else None, label=label)
            for ax, what in ((ax_train, "train loss"), (ax_val, "val loss")):
                ax.set(title=f"{name}: {what}", xlabel="step", ylabel=what)
                ax.grid(alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize=7)
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=90)
    return out.getvalue()


CSS = ("body{font-family:system-ui,sans-serif,'Noto Sans CJK SC','Source Han Sans SC','WenQuanYi Micro Hei',"
       "'PingFang SC','Microsoft YaHei';margin:1.5em;max-width:1300px}table{border-collapse:collapse;margin:.3em 0}"
       "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:right}td.text{text-align:left}"
       "tr.best{background:#e6f4e6}h3{font-size:14px;margin:1em 0 .2em}img{max-width:100%}"
       "pre{white-space:pre-wrap;background:#f6f6f6;padding:4px}")


def render(runs: List[dict], title: str, png: Optional[bytes]) -> str:
    winner = best(runs)
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset=utf-8><meta name=generator content='mindlab recipe.report'>"
             f"<title>{e(title)}</title><style>{CSS}</style></head><body><h1>{e(title)}</h1>"]
    if winner is not None:
        parts.append(f"<p>Best by {e(runs[0]['metric'])} ({e(runs[0].get('goal', 'max'))}): "
                     f"<b>{e(winner['variant'])}</b></p>")
    parts.append("".join(t.html() for t in tables(runs)))
    if png:
        parts.append(f"<h2>training and validation loss</h2><img alt='training and validation loss per stage' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    seen = set()
    for r in runs:
        for s in r["stages"]:
            if s["samples"] and s.get("key", id(s)) not in seen:
                seen.add(s.get("key", id(s)))
                who = "every variant" if len(runs) > 1 and shared(runs, s["name"]) else r["variant"]
                parts.append(f"<h2>generations: {e(who)}, {e(s['name'])}</h2>")
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


class SweepReport(Callback):
    """Hydra callback of `python -m recipe -m ...`: the sweep's report.html once every variant has run."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)  # HydraConfig is unset once the jobs end; this config resolves as theirs
        if sweep.is_dir() and variants_in(sweep):
            print(f"[recipe] sweep report: {write(sweep)}")


@entry_point
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m recipe.report", description=__doc__.split("\n")[0])
    parser.add_argument("directory", help="a recipe run directory, or a sweep of them")
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such directory; give a recipe run directory or a sweep of them")
    print(f"report: {write(directory)}")


if __name__ == "__main__":
    sys.exit(main())
