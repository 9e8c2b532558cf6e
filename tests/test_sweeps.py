"""Sweep presets in sweeps/ compose job by job, and `python -m sweeps.report` compares a multirun's runs."""
import base64
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import types
from html.parser import HTMLParser

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from base.validate import validate
from conftest import ROOT, absent, compose_cfg, invoke
from helpers import SYNTHETIC, eval_line, train_line, write_job
from sweeps.report import build

JOBS = {"lr": 3, "lr_ctx": 9, "data_mix": 3, "batch": 4, "scaling": 5}


def sweep_jobs(name: str) -> list:
    """The jobs `train.py -m +sweep=<name>` launches: the basic sweeper's own expansion of its params."""
    params = compose_cfg(f"+sweep={name}", hydra_config=True).hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    [batch] = BasicSweeper.split_arguments(parsed, None)
    return batch


@pytest.mark.parametrize("name", JOBS)
def test_each_job_of_each_sweep_preset_composes_and_validates(name):
    jobs = sweep_jobs(name)
    assert len(jobs) == JOBS[name]
    configs = [compose_cfg(f"+sweep={name}", *job) for job in jobs]
    for cfg in configs:
        validate(cfg, world_size=1)
    if name == "lr":
        assert [c.optim.lr for c in configs] == [3e-4, 1e-3, 3e-3]
    if name == "lr_ctx":
        assert {(c.optim.lr, c.data.seq_len) for c in configs} == {(lr, s) for lr in (3e-4, 1e-3, 3e-3)
                                                                    for s in (128, 256, 512)}
    if name == "data_mix":
        assert [c.data.name for c in configs] == ["mix_code_heavy", "mix_books_heavy", "mix_balanced"]
        assert [c.data.weights.code for c in configs] == [0.5, 0.125, 0.2]
    if name == "batch":
        assert [(c.trainer.micro_batch_size, c.trainer.grad_accum) for c in configs] == [(16, 1), (8, 2), (4, 4),
                                                                                          (2, 8)]
        assert {c.trainer.micro_batch_size * c.trainer.grad_accum for c in configs} == {16}
    if name == "scaling":
        assert [c.model.name for c in configs] == ["tiny", "small", "125m", "350m", "1b"]
        assert {c.model.vocab_size for c in configs} == {8192}


def test_optuna_preset_searches_a_log_uniform_lr_minimizing_the_returned_val_loss():
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override

    sweeper = compose_cfg("+sweep=lr_optuna", hydra_config=True).hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "minimize"
    [override] = OverridesParser.create().parse_overrides([f"optim.lr={sweeper.params['optim.lr']}"])
    lr = create_optuna_distribution_from_override(override)
    assert (type(lr).__name__, lr.low, lr.high) == ("LogUniformDistribution", 1e-4, 1e-2)
    for value in (lr.low, lr.high):  # the interval's ends compose and validate as trials
        validate(compose_cfg("+sweep=lr_optuna", f"optim.lr={value}"), world_size=1)


def test_slurm_launcher_preset_composes_with_a_sweep():
    launcher = compose_cfg("+sweep=lr", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                           hydra_config=True).hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.tasks_per_node, launcher.timeout_min) == ("gpu", 1, 240)


@pytest.mark.slow  # a train.py process, ~5 s
def test_presets_are_found_when_train_py_starts_from_another_directory(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "+sweep=lr_ctx", "hydra/launcher=slurm",
                           "--cfg", "hydra"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hydra_cfg = OmegaConf.create(proc.stdout).hydra
    assert dict(hydra_cfg.sweeper.params) == {"optim.lr": "3e-4,1e-3,3e-3", "data.seq_len": "128,256,512"}
    assert hydra_cfg.launcher._target_.endswith("SlurmLauncher")


# --- the report on a synthetic multirun dir -------------------------------------------------------------

class Dom(HTMLParser):
    """Rows of the #runs table as {column title: (text, data-value)}, image sources, unfinished-run items."""

    def __init__(self, html: str):
        super().__init__()
        self.headers, self.rows, self.images, self.unfinished = [], {}, [], []
        self.table = self.row = self.cell = self.section = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.table = attrs.get("id")
        elif tag == "tr" and self.table == "runs" and "data-run" in attrs:
            self.row = self.rows.setdefault(attrs["data-run"], {"_class": attrs.get("class"), "_cells": []})
        elif tag in ("td", "th") and self.table == "runs":
            self.cell = {"tag": tag, "text": "", "value": attrs.get("data-value")}
        elif tag == "img":
            self.images.append(attrs)
        elif tag == "li" and "data-run" in attrs:
            self.unfinished.append(attrs["data-run"])

    def handle_data(self, data):
        if self.cell is not None:
            self.cell["text"] += data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            if self.cell["tag"] == "th":
                self.headers.append(self.cell["text"])
            else:
                self.row["_cells"].append((self.cell["text"], self.cell["value"]))
            self.cell = None
        elif tag == "table":
            self.table = None
        elif tag == "tr" and self.row is not None:
            self.row.update(zip(self.headers, self.row.pop("_cells")))
            self.row = None


@pytest.fixture
def synthetic_sweep(tmp_path):
    root = tmp_path / "multirun"
    for num, (lr, lines, status, partial) in SYNTHETIC.items():
        write_job(root, num, lr, lines, status, partial)
    return root


def test_report_lists_every_run_with_its_varied_values_and_the_numbers_of_its_metrics_file(synthetic_sweep):
    dom = Dom(open(build(str(synthetic_sweep), use_wandb=False)).read())
    assert dom.headers[:3] == ["run", "optim.lr", "status"]  # +sweep and max_steps are the same in every job
    assert list(dom.rows) == ["0", "1", "2", "3", "4"]
    assert [dom.rows[n]["optim.lr"][0] for n in dom.rows] == ["0.001", "0.002", "0.003", "0.004", "0.005"]
    assert [dom.rows[n]["status"][0] for n in dom.rows] == ["finished", "finished", "failed", "running", "unknown"]
    for num, (_, lines, _, _) in SYNTHETIC.items():
        row, train = dom.rows[str(num)], [m for m in lines if "tokens_per_sec" in m]
        evals = [m for m in lines if "val_loss" in m]
        expected = {"final val loss": evals[-1]["val_loss"] if evals else None,
                    "best val loss": min(m["val_loss"] for m in evals) if evals else None,
                    "final loss": train[-1]["loss"] if train else None,
                    "tokens/s": statistics.median([m["tokens_per_sec"] for m in train][1:]) if len(train) > 1
                    else (train[0]["tokens_per_sec"] if train else None),
                    "tokens seen": train[-1]["tokens_seen"] if train else None}
        for column, value in expected.items():
            assert row[column][1] == (None if value is None else repr(value)), (num, column)
            if value is None:
                assert row[column][0] == "—"
    assert dom.rows["1"]["final val loss"][0] == "3.4500" and dom.rows["1"]["step"][0] == "30"
    assert [dom.rows[n]["skipped"][0] for n in "012"] == ["0", "1", "0"]  # job 1 has one skipped update
    assert dom.rows["1"]["tokens/s"][1] == repr(1125.0)  # median of 1100 and 1150: the first interval is left out
    assert dom.rows["3"]["step"][0] == "10"  # the half-written line of the running job is not read
    # best = lowest final val loss among finished runs: job 2's 3.2 is lower but it crashed
    assert [n for n, row in dom.rows.items() if row["_class"] == "best"] == ["1"]
    assert dom.unfinished == ["2", "3", "4"]
    html = open(synthetic_sweep / "report.html").read()
    assert "TrainingStopped: 5 consecutive skipped steps at step 24" in html
    assert 'id="sources"' in html and "val_loss_by_source.png" in html
    for img in dom.images:  # each embedded image is the PNG written beside the page
        data = base64.b64decode(img["src"].removeprefix("data:image/png;base64,"))
        assert data == (synthetic_sweep / img["data-file"]).read_bytes() and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(i["data-file"] for i in dom.images) == ["curves_optim.lr.png", "val_loss_by_source.png"]


def test_report_shows_the_objectives_final_val_metrics(tmp_path):
    """A DPO sweep: the objective's metrics at the last evaluation, one column each (per-source copies left out)."""
    root = tmp_path / "multirun"
    for num, (acc, kl) in enumerate([(0.6, 0.01), (0.8, 0.05)]):
        evals = [{**eval_line(10, 0.69), "val_rewards/accuracies": 0.5, "val_kl": 0.0},
                 {**eval_line(20, 0.6 - num / 10), "val_rewards/accuracies": acc, "val_kl": kl,
                  "val_rewards/accuracies/code": acc, "val_kl/code": kl}]
        write_job(root, num, f"0.00{num + 1}", [train_line(10, 0.7, 900.0), train_line(20, 0.6, 900.0), *evals],
                  {"status": "finished", "step": 20})
    html = open(build(str(root), use_wandb=False)).read()
    table = html[html.index('<table id="metrics">'):]
    table = table[:table.index("</table>")]
    assert "<th>kl</th><th>rewards/accuracies</th></tr>" in table and "/code" not in table
    assert table.count('data-run="') == 2 and '<td data-value="0.8">0.8000</td>' in table
    assert '<td data-value="0.05">0.0500</td>' in table


@pytest.mark.slow  # a headless Chromium, ~5 s
def test_report_renders_in_headless_chromium(synthetic_sweep, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        absent("chromium is not installed (Debian: apt-get install -y chromium)")
    page = build(str(synthetic_sweep), use_wandb=False)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,2400"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", f"file://{page}"], capture_output=True, text=True,
                         timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = Dom(dom.stdout)
    assert list(rendered.rows) == ["0", "1", "2", "3", "4"] and rendered.rows["1"]["_class"] == "best"
    assert len(rendered.images) == 2 and all(i["src"].startswith("data:image/png;base64,") for i in rendered.images)
    shot = tmp_path / "report.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", f"file://{page}"], capture_output=True, timeout=90,
                   check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# --- the W&B Report path, with the wandb-workspaces API mocked at its boundary ----------------------------

def fake_reports_api(saved: list) -> types.ModuleType:
    """A stand-in for `wandb_workspaces.reports.v2`: records the objects built and each saved report."""
    class Obj:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class Report(Obj):
        entity = "default-entity"
        url = "https://wandb.example/team/mindlab/reports/sweep"

        def save(self):
            saved.append(self)

    module = types.ModuleType("wandb_workspaces.reports.v2")
    module.Report = Report
    module.Runset = module.LinePlot = module.MarkdownBlock = module.PanelGrid = type("Block", (Obj,), {})
    return module


def test_wandb_report_is_created_for_the_group_when_online(synthetic_sweep, monkeypatch):
    """Mocked at the boundary: `wandb_workspaces.reports.v2` is a fake module (a real report needs a W&B
    server). Checks which report mindlab asks for: the sweep's group, project and entity, the runs table."""
    saved = []
    monkeypatch.setitem(sys.modules, "wandb_workspaces", types.ModuleType("wandb_workspaces"))
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports", types.ModuleType("wandb_workspaces.reports"))
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports.v2", fake_reports_api(saved))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    build(str(synthetic_sweep))
    assert saved == []  # no API key: offline, no report
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    html = open(build(str(synthetic_sweep))).read()
    [report] = saved
    assert (report.project, report.entity) == ("mindlab", "team")
    table, grid = report.blocks
    assert "| **1** (best) | 0.002 | finished |" in table.text
    [runset] = grid.runsets
    assert (runset.project, runset.entity, runset.filters) == ("mindlab", "team", "Group = '/sweeps/g'")
    assert [p.y for p in grid.panels][-1] == ["val_loss/books", "val_loss/code"]
    assert "https://wandb.example/team/mindlab/reports/sweep" in html


def test_wandb_report_blocks_are_valid_for_the_real_reports_api(synthetic_sweep, monkeypatch):
    """The real wandb-workspaces classes validate what mindlab builds; only `Report.save` (the network call)
    and the URL it yields are mocked."""
    wr = pytest.importorskip("wandb_workspaces.reports.v2",
                             reason="wandb-workspaces is not installed (requirements: wandb-workspaces==0.4.13)")
    saved = []
    monkeypatch.setattr(wr.Report, "save", lambda self, *args, **kwargs: saved.append(self) or self)
    monkeypatch.setattr(wr.Report, "url", property(lambda self: "https://wandb.example/r"))
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    build(str(synthetic_sweep))
    [report] = saved
    assert isinstance(report.blocks[1], wr.PanelGrid) and report.blocks[1].runsets[0].filters == "Group = '/sweeps/g'"


# --- a real multirun ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_real_two_job_multirun_is_reported_with_its_lrs_and_losses(tmp_path):
    """train.py -m over two lrs on model=tiny (each job compiles its own graphs: a third would show nothing
    more), then the report CLI. The default data comes from the shared cache (~/.cache/mindlab/data, keyed by
    what builds it and built under a lock), as the other train.py runs of the suite read it: its own cache cost
    ~20 s of CPU to build the same data again."""
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "-m", "optim.lr=1e-3,3e-3",
                           "model=tiny", "trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=3",
                           "optim.warmup_steps=2", "data.seq_len=64", "trainer.micro_batch_size=4",
                           "trainer.eval_batches=1", "logger.progress_bar=false", f"hydra.sweep.dir={sweep_dir}",
                           "logger=wandb"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("WANDB_")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # two offline W&B runs, one group (this sweep), named by the value the sweep varies
    cfgs = [OmegaConf.load(sweep_dir / n / "config.yaml") for n in "01"]
    assert {c.logger.group for c in cfgs} == {str(sweep_dir)}
    assert [c.logger.run_name for c in cfgs] == ["optim.lr=0.001", "optim.lr=0.003"]
    wandb_runs = [glob.glob(str(sweep_dir / n / "wandb" / "offline-run-*" / "run-*.wandb")) for n in "01"]
    assert [len(r) for r in wandb_runs] == [1, 1] and len({r[0].rsplit("-", 1)[1] for r in wandb_runs}) == 2
    report = invoke("report", [str(sweep_dir), "--no-wandb"])  # the report CLI's main, in this process
    assert report.code == 0, report.err[-3000:]
    dom = Dom((sweep_dir / "report.html").read_text())
    assert list(dom.rows) == ["0", "1"]
    assert [row["optim.lr"][0] for row in dom.rows.values()] == ["0.001", "0.003"]
    for num, row in dom.rows.items():
        lines = [json.loads(line) for line in open(sweep_dir / num / "metrics.jsonl")]
        evals = [m for m in lines if "val_loss" in m]
        assert [m["step"] for m in evals] == [0, 3, 6]
        assert row["final val loss"][1] == repr(evals[-1]["val_loss"])
        assert row["best val loss"][1] == repr(min(m["val_loss"] for m in evals))
        assert row["final loss"][1] == repr([m for m in lines if "loss" in m][-1]["loss"])
        assert row["status"][0] == "finished" and row["tokens seen"][1] == repr(6 * 4 * 64)
    assert (sweep_dir / "curves_optim.lr.png").is_file()
