"""The W&B logger: what it hands to wandb (mocked at the boundary), and real offline runs on disk."""
import glob
import json
import os
import sys
import types

import pytest
from omegaconf import OmegaConf

from conftest import train_main

SMALL = ["model.num_layers=1", "data.seq_len=64", "trainer.micro_batch_size=4", "trainer.eval_batches=1",
         "trainer.log_every=2", "optim.warmup_steps=1", "logger.progress_bar=false"]


class FakeRun:
    def __init__(self):
        self.logged, self.summary, self.finished = [], {}, False
        self.settings = types.SimpleNamespace(sync_dir="/runs/x/wandb/offline-run-1")

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = {}

    def init(**kwargs):
        calls.update(kwargs)
        calls["run"] = FakeRun()
        return calls["run"]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=lambda **kw: kw))
    return calls


def logger_cfg(**logger):
    return OmegaConf.create({"logger": {"project": "p", "entity": None, "group": "multirun/x", "run_name": "optim.lr=0.1",
                                        "tags": ["t"], "job_type": "train", "mode": "auto", **logger},
                             "optim": {"lr": "${oc.decode:'0.1'}"}})


def test_logger_hands_group_name_id_and_resolved_config_to_wandb(fake_wandb, monkeypatch, tmp_path):
    from trainer.wandb_logger import WandbLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = WandbLogger(logger_cfg(), str(tmp_path), "run123")
    assert {k: fake_wandb[k] for k in ("project", "group", "name", "id", "resume", "mode", "tags")} == {
        "project": "p", "group": "multirun/x", "name": "optim.lr=0.1", "id": "run123", "resume": "allow",
        "mode": "offline", "tags": ["t"]}
    assert fake_wandb["config"]["optim"]["lr"] == 0.1  # resolved, not the interpolation
    logger.log({"step": 10, "loss": 2.5, "tokens_per_sec": 100.0, "tokens_seen/code": 640})
    logger.log({"step": 20, "loss": 2.0, "tokens_per_sec": 300.0})
    logger.log({"step": 20, "val_loss": 2.2, "val_loss/code": 2.1})
    logger.log({"step": 21, "skipped": "non-finite loss", "loss": None, "data_position": 84})
    logger.close()
    run = fake_wandb["run"]
    assert run.logged[0] == (10, {"loss": 2.5, "tokens_per_sec": 100.0, "tokens_seen/code": 640})
    assert run.logged[2] == (20, {"val_loss": 2.2, "val_loss/code": 2.1})
    assert run.logged[3] == (21, {"data_position": 84, "skipped": 1})
    assert run.summary == {"best_val_loss": 2.2, "mean_tokens_per_sec": 300.0} and run.finished


def test_an_offline_run_says_once_where_it_is_and_how_to_sync_it(fake_wandb, monkeypatch, tmp_path, capsys):
    from trainer.wandb_logger import WandbLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    WandbLogger(logger_cfg(), str(tmp_path), "r").log({"step": 1, "loss": 2.0})
    assert capsys.readouterr().out == ("[wandb] offline run in /runs/x/wandb/offline-run-1; upload it with: wandb sync "
                                       "/runs/x/wandb/offline-run-1\n")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    WandbLogger(logger_cfg(), str(tmp_path), "r")
    assert capsys.readouterr().out == ""


def test_online_only_with_an_api_key(fake_wandb, monkeypatch, tmp_path):
    from trainer.wandb_logger import WandbLogger

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    WandbLogger(logger_cfg(), str(tmp_path), "r")
    assert fake_wandb["mode"] == "online"
    WandbLogger(logger_cfg(mode="offline"), str(tmp_path), "r")
    assert fake_wandb["mode"] == "offline"


def run(cwd, monkeypatch, *args):
    """`python train.py ARGS` from `cwd` without any WANDB_ variable, as train.py's main in this process: stdout."""
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    code, out, err = train_main(cwd, monkeypatch, *args)
    assert code == 0, err[-3000:]
    return out


def run_id(job_dir):
    ckpt = open(os.path.join(job_dir, "checkpoints", "latest")).read().strip()
    return json.load(open(os.path.join(job_dir, "checkpoints", ckpt, "state.json")))["run_id"]


@pytest.mark.slow
def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, monkeypatch):
    """(One group per multirun and names from the swept values: tests/test_sweeps.py's real multirun.)"""
    job = str(tmp_path / "run")
    out = run(tmp_path, monkeypatch, "logger=wandb", "trainer.max_steps=4", *SMALL, f"hydra.run.dir={job}")
    first = run_id(job)
    [offline] = glob.glob(os.path.join(job, "wandb", f"offline-run-*-{first}"))
    assert os.path.isfile(os.path.join(offline, f"run-{first}.wandb"))
    assert out.count("[wandb] offline run in") == 1 and f"upload it with: wandb sync {offline}\n" in out
    run(tmp_path, monkeypatch, "logger=wandb", "trainer.max_steps=6", *SMALL, f"hydra.run.dir={job}")  # resumes at 4
    assert run_id(job) == first
    assert len(glob.glob(os.path.join(job, "wandb", f"offline-run-*-{first}"))) == 2


@pytest.mark.slow
def test_disabled_mode_writes_no_wandb_files(tmp_path, monkeypatch):
    run(tmp_path, monkeypatch, "logger=wandb", "logger.mode=disabled", "trainer.max_steps=2", *SMALL,
        f"hydra.run.dir={tmp_path / 'run'}")
    assert not os.path.exists(tmp_path / "run" / "wandb")
    assert os.path.exists(tmp_path / "run" / "metrics.jsonl")
