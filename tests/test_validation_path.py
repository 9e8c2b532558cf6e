"""One validation path: the dry run checks a config with the run's rules for its device (base/validate.py: all but
this host's devices and processes), so a layout it plans, or prints, starts. Each config here is validated twice, as
a dry run and as the run on its own machine (devices_here reporting a full node, every worker launched), and the
layouts the advisor prints are validated as the run they start."""
import pytest

import base.validate
from base.errors import ConfigError
from base.schema import world_size
from base.validate import validate
from conftest import compose_cfg
from planner.advisor import Search, global_batch
from planner.dry_run import SHOWN_LAYOUTS

CASES = [
    ("model=13b", "device=h100", "parallel=tp8pp2", "nodes=2", "model.flash_attention=true"),  # no GPU kernel
    ("model=13b", "device=h100", "parallel=tp8pp2", "nodes=2", "parallel.cp=2", "nodes=4"),  # cp: Ascend only
    ("model=13b", "device=h100", "parallel=tp8pp2", "nodes=2", "parallel.tp_overlap=true"),  # Ascend's passes
    ("model=13b", "device=cpu", "parallel=tp8pp2"),  # no tensor parallelism on CPU
    ("model=13b", "device=ascend910b", "parallel=tp8pp2", "parallel.cp=2", "parallel.vp=2", "parallel.tp_overlap=true",
     "nodes=4", "data.seq_len=4096"),
    ("model=13b", "device=ascend910b", "parallel=tp8pp2", "parallel.cp=4", "parallel.cp_algo=ulysses", "nodes=8",
     "data.seq_len=4096"),  # tp 8 x ulysses 4 = 32 does not divide 40 heads
    ("model=7b", "device=a100", "parallel=tp4pp2dp2", "parallel.zero3=true", "parallel.vp=2", "nodes=2"),
]


def outcome(cfg, **machine):
    try:
        validate(cfg, **machine)
    except ConfigError as err:
        return str(err)
    return "ok"


@pytest.fixture
def full_node(monkeypatch):
    """This host as one node of the config's device: devices_here reports devices_per_node."""
    monkeypatch.setattr(base.validate, "devices_here", lambda target: 8)


@pytest.mark.parametrize("overrides", CASES, ids=[" ".join(c[1:]) for c in CASES])
def test_the_dry_run_and_the_run_refuse_the_same_configs(overrides, full_node):
    run = compose_cfg(*overrides)
    dry = compose_cfg(*overrides, "dry_run=true")
    assert outcome(dry) == outcome(run, world_size=world_size(run.parallel))


def test_the_refusals_are_the_devices_rules():
    """The dry run refuses what the run would: flash attention and cp have no GPU kernel."""
    assert outcome(compose_cfg(*CASES[0], "dry_run=true")).startswith("model.flash_attention: ")
    assert outcome(compose_cfg(*CASES[1], "dry_run=true")).startswith("parallel.cp: ")
    assert outcome(compose_cfg(*CASES[4], "dry_run=true")) == "ok"
    assert outcome(compose_cfg(*CASES[5], "dry_run=true")).startswith("parallel.cp_algo: ")


@pytest.mark.parametrize("argv", [
    ("model=7b", "device=ascend910b", "nodes=4", "stage=long_context", "data.seq_len=131072"),
    ("model=70b", "device=ascend910b", "nodes=16", "stage=long_context", "data.seq_len=131072"),
    ("model=13b", "device=h100", "nodes=2", "data.seq_len=4096", "model.flash_attention=null"),
], ids=["ascend910b-7b-128k", "ascend910b-70b-128k", "h100-13b-4k"])
def test_every_printed_layout_passes_the_runs_checks(argv, full_node):
    """The advisor's table rows (its SHOWN_LAYOUTS fastest), as the overrides it prints, validated as the run on each
    node; at 128k (docs/long_context.md's commands) they split the sequence, and on H100 they do not (no kernel)."""
    cfg = compose_cfg(*argv, "dry_run=true")
    devices = int(argv[2].split("=")[1]) * cfg.device.devices_per_node
    ranked = Search(cfg).ranked(devices, global_batch(cfg))
    assert ranked and all((o.candidate.cp > 1) == (cfg.data.seq_len == 131072) for o in ranked[:SHOWN_LAYOUTS])
    init = ["stage.init_from=/ckpt/step_000400"] if "stage=long_context" in argv else []
    for option in ranked[:SHOWN_LAYOUTS]:
        run = compose_cfg(*argv, *option.candidate.overrides(), *init, "node_rank=1")
        assert outcome(run, world_size=devices) == "ok", option.candidate.describe()
