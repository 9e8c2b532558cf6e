"""What a user types on Ascend/GPU nodes, checked on any machine (a node is faked where the test needs one): it is either right as composed, or refused in
one line before anything starts.

    precision vs flash attention     fp32 with flash attention is refused (the kernel takes fp16/bf16)
    the device preset vs the machine `device=ascend910b` on a box without Ascend (h100 on an Ascend box): one
                                     line, exit 2, no msrun; the device count against the machine's device files
    objectives outside the plan      rm, dpo, ppo under tp/pp refused at validation
    across nodes                     the node keys, one shared run directory, the msrun each node starts, the
                                     README's commands and the sbatch recipe as documented, `latest` after a barrier
"""
import os
import shlex
import stat
import subprocess
import sys
import threading
import time

import pytest

import base.validate
from base.errors import ConfigError
from base.validate import validate
from conftest import ROOT, compose_cfg, train_main
from planner.dry_run import dry_run_report

README = os.path.join(ROOT, "README.md")
PARALLEL_DOC = os.path.join(ROOT, "docs", "parallel.md")
# docs/parallel.md's multi-node commands, copied verbatim (test_readme_commands_are_these checks they still are).
README_NODE = ("python train.py model=13b parallel=tp8pp2 device=ascend910b nodes=2 node_rank=$R master_addr=$HEAD "
               "hydra.run.dir=/shared/runs/13b")
README_SBATCH = "sbatch --nodes=2 scripts/slurm_msrun.sbatch model=13b parallel=tp8pp2 device=ascend910b"


def refused(*overrides, world_size=1) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides), world_size=world_size)
    assert "\n" not in str(err.value)
    return err.value


# --- precision and flash attention ----------------------------------------------------------------------------


@pytest.mark.parametrize("flash", [None, "true"])
def test_fp32_with_flash_attention_is_refused_naming_both_keys(flash):
    extra = [f"model.flash_attention={flash}"] if flash else []
    err = refused("model=13b", "parallel=tp8pp2", "device=ascend910b", "precision=fp32", "dry_run=true", *extra)
    assert err.key == "precision"
    for words in ("model.flash_attention", "precision=auto (bf16 on device=ascend910b)",
                  "model.flash_attention=false"):
        assert words in str(err), str(err)


def test_the_13b_plan_on_ascend_is_bf16_with_flash_attention():
    argv = ["model=13b", "parallel=tp8pp2", "device=ascend910b", "dry_run=true"]
    cfg = compose_cfg(*argv)
    validate(cfg)
    assert cfg.precision.compute_dtype == "bf16"
    assert "compute bf16, recompute none, attention flash (heads split over tp=8)," in dry_run_report(cfg, argv)
    validate(compose_cfg(*argv, "precision=fp32", "model.flash_attention=false"))  # fp32 attention on purpose


# --- objectives the tensor/pipeline plan does not lay out -----------------------------------------------------


STAGES = {"rm": ["data=preferences"], "dpo": ["data=preferences"],
          "ppo": ["data=instructions", "objective.reward_model=rm_run"]}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("layout", [["parallel=tp8pp2"], ["parallel=dp8", "parallel.optimizer_shard=true"]])
def test_objectives_outside_the_plan_are_refused_under_sharding(stage, layout):
    """Refused rather than planned: the plan lays out the language model alone (their heads, reference model and
    rollouts are outside it), and nothing sharded can run here to check a plan of them against."""
    stage_args = [f"stage={stage}", "model=13b", "device=ascend910b", "stage.allow_random_init=true", "dry_run=true",
                  *STAGES[stage]]
    err = refused(*stage_args, *layout)
    assert err.key == "parallel" and f"objective={stage}" in str(err)
    if stage != "ppo":  # data parallel is theirs (ppo: one device)
        validate(compose_cfg(*stage_args, "parallel=dp8", "parallel.optimizer_shard=false"))


# --- the device preset against this machine -------------------------------------------------------------------


def absent_preset() -> tuple:
    """(a device preset, its target) this machine has no device of: the refusal below is checked on any machine
    (ascend910b on a CPU or GPU box, h100 on an Ascend one)."""
    for preset, target in (("ascend910b", "Ascend"), ("h100", "GPU")):
        if base.validate.devices_here(target) == 0:
            return preset, target
    pytest.skip("this machine has Ascend and GPU devices: no device preset it lacks")


@pytest.mark.slow  # two train.py processes, ~5 s each
@pytest.mark.parametrize("layout", [[], ["model=13b", "parallel=tp8pp2"]])
def test_a_preset_of_a_device_this_machine_lacks_is_one_line_and_starts_nothing(tmp_path, layout):
    """The acceptance command, as typed: exit 2, one line on stderr, no traceback, no msrun launch."""
    preset, target = absent_preset()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"device={preset}", *layout],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"config error: device: device={preset}: this machine has no {target} "
                                                "devices; plan with dry_run=true or use device=cpu"]
    assert "[launch]" not in proc.stdout and "msrun" not in proc.stdout


def test_devices_here_counts_the_machines_devices():
    """What the refusal above reads, against the device files the drivers make: /dev/davinciN for Ascend,
    /dev/nvidiaN for NVIDIA GPUs, which MindSpore can use only where its GPU plugin finds the CUDA libraries it links
    (make device-check installs them: scripts/gpu_runtime.py). On a CPU box: 0 and 0."""
    import glob
    import re

    def count(pattern):
        return len([d for d in glob.glob(pattern) if re.fullmatch(r".*\d+", d)])

    assert base.validate.devices_here("Ascend") == count("/dev/davinci*")
    plugin = os.path.join(os.path.dirname(__import__("mindspore").__file__), "lib", "plugin",
                          "libmindspore_gpu.so.11.6")
    loadable = os.path.exists(plugin) and "not found" not in subprocess.run(["ldd", plugin], capture_output=True,
                                                                             text=True).stdout
    assert base.validate.devices_here("GPU") == (count("/dev/nvidia*") if loadable else 0)


def test_a_layout_larger_than_the_node_names_nodes(monkeypatch):
    monkeypatch.setattr(base.validate, "devices_here", lambda target: 8)
    err = refused("model=13b", "parallel=tp8pp2", "device=ascend910b", world_size=16)
    assert err.key == "parallel" and "16 workers on this node, which has 8 Ascend devices; across nodes set nodes=2" \
        in str(err)
    validate(compose_cfg("model=13b", "parallel=tp8pp2", "device=ascend910b", "nodes=2"), world_size=16)


def test_a_cpu_run_of_a_sharded_layout_says_to_set_the_device():
    err = refused("model=13b", "parallel=tp8pp2")
    assert "found CPU (device=cpu)" in str(err) and "set device=ascend910b" in str(err)


# --- across nodes ---------------------------------------------------------------------------------------------


@pytest.fixture
def nodes_of_eight(monkeypatch):
    """A node of 8 Ascend devices, and a relaunch that records what it would start instead of starting it."""
    import distributed.launch

    monkeypatch.setattr(base.validate, "devices_here", lambda target: 8 if target == "Ascend" else 0)
    started = []
    monkeypatch.setattr(distributed.launch, "relaunch", lambda *args: started.append(args) or 0)
    return started


def test_each_node_relaunches_its_share_into_the_shared_run_dir(tmp_path, monkeypatch, nodes_of_eight):
    run_dir = tmp_path / "shared" / "13b"
    code, _, err = train_main(tmp_path, monkeypatch, "model=13b", "parallel=tp8pp2", "device=ascend910b", "nodes=2",
                              "node_rank=1", "master_addr=head", f"hydra.run.dir={run_dir}")
    assert code == 0, err
    assert nodes_of_eight == [(16, str(run_dir), 2, 1, "head", 8118)]


@pytest.mark.parametrize("missing, key", [("master_addr=head", "master_addr"), ("hydra.run.dir=RUN", "hydra.run.dir")])
def test_a_node_without_the_master_or_the_shared_dir_is_refused(tmp_path, monkeypatch, nodes_of_eight, missing, key):
    argv = ["model=13b", "parallel=tp8pp2", "device=ascend910b", "nodes=2", "node_rank=0", "master_addr=head",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, _, err = train_main(tmp_path, monkeypatch, *[a for a in argv if a.split("=")[0] != missing.split("=")[0]])
    assert code == 2 and f"config error: {key}: " in err and nodes_of_eight == []


@pytest.mark.parametrize("overrides, key", [(["nodes=2", "node_rank=2"], "node_rank"), (["node_rank=1"], "node_rank"),
                                            (["nodes=3"], "nodes")])
def test_node_keys_out_of_range(overrides, key):
    assert refused("model=13b", "parallel=tp8pp2", "device=ascend910b", "dry_run=true", *overrides).key == key


def test_the_msrun_a_node_starts(tmp_path):
    from distributed.launch import Nodes, msrun_command

    cmd = msrun_command(16, str(tmp_path), "train.py", ["model=13b"], Nodes(2, 1, "head", 8118))
    for flag in ("--worker_num=16", "--local_worker_num=8", "--master_addr=head", "--master_port=8118",
                 "--node_rank=1", f"--log_dir={tmp_path / 'workers' / 'node1'}"):
        assert flag in cmd
    assert cmd[-2:] == ["model=13b", f"hydra.run.dir={tmp_path}"]
    assert list(Nodes(2, 1).ranks(16)) == list(range(8, 16))  # msrun's ranks on node 1 (its worker_<rank>.log)


def test_readme_commands_are_these():
    with open(PARALLEL_DOC, encoding="utf-8") as f:
        text = f.read()
    assert f"    {README_NODE}\n" in text and f"    {README_SBATCH}\n" in text


def _node_overrides(line: str, rank: int):
    """A README train.py line's overrides on node `rank`, the shell's variables filled in: (config, hydra)."""
    argv = [a.replace("$R", str(rank)).replace("$HEAD", "node0") for a in shlex.split(line.split(" train.py ", 1)[1])]
    return [a for a in argv if not a.startswith("hydra.")], [a for a in argv if a.startswith("hydra.")]


def _check_node(overrides, hydra):
    """As the dry run composes and validates it, and as a node of 8 Ascend devices would before relaunching."""
    from train import check_multi_node

    validate(compose_cfg(*overrides, "dry_run=true"))
    cfg = compose_cfg(*overrides)
    validate(cfg, world_size=cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp)
    check_multi_node(cfg, hydra)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_readme_node_command_passes_validation(monkeypatch, rank):
    monkeypatch.setattr(base.validate, "devices_here", lambda target: 8)
    _check_node(*_node_overrides(README_NODE, rank))


def _fake(bin_dir, name, body):
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def sbatch_lines(tmp_path, args):
    """What scripts/slurm_msrun.sbatch runs on each of 2 nodes (Slurm faked: srun runs its command per node,
    scripts/venv.sh prints it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "scontrol", 'printf "gpu-a\\ngpu-b\\n"')
    _fake(bin_dir, "srun", 'shift; for n in 0 1; do SLURM_NODEID=$n "$@"; done')
    (tmp_path / "scripts").mkdir()
    _fake(tmp_path / "scripts", "venv.sh", 'printf "%q " "$@"; echo')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(tmp_path)}
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_msrun.sbatch"), *args], env=env,
                         capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines()]


def test_the_sbatch_recipe_runs_train_py_on_each_node(tmp_path):
    lines = sbatch_lines(tmp_path, ["model=13b", "parallel=tp8pp2", "device=ascend910b"])
    assert lines == [f"python train.py model=13b parallel=tp8pp2 device=ascend910b nodes=2 node_rank={node} "
                     "master_addr=gpu-a master_port=8118 hydra.run.dir=runs/slurm-42" for node in (0, 1)]


def test_the_readme_sbatch_command_passes_validation(tmp_path, monkeypatch):
    monkeypatch.setattr(base.validate, "devices_here", lambda target: 8)
    for line in sbatch_lines(tmp_path, shlex.split(README_SBATCH.split("slurm_msrun.sbatch ", 1)[1])):
        _check_node(*_node_overrides(line, 0))


def test_latest_moves_after_every_rank_wrote_its_slices(monkeypatch, tmp_path):
    """ShardedModule.save on two ranks (threads; MindSpore's barrier a threading.Barrier): rank 1 writes its slices
    slowly, and rank 0's `latest` still comes after them."""
    import distributed.semi_auto
    from base import checkpoint
    from trainer.module import ShardedModule

    events, lock, world = [], threading.Lock(), threading.Barrier(2)

    def log(what):
        with lock:
            events.append(what)

    def save_rank_slices(step_dir, network, rank, run_dir):
        time.sleep(0.3 if rank == 1 else 0)
        log(f"slices {rank}")

    monkeypatch.setattr(distributed.semi_auto, "save_rank_slices", save_rank_slices)
    monkeypatch.setattr(distributed.semi_auto, "barrier", world.wait)
    monkeypatch.setattr(checkpoint, "write_metadata", lambda *args: log("state.json"))
    monkeypatch.setattr(checkpoint, "set_latest", lambda root, step_dir: log(f"latest {os.path.basename(step_dir)}"))

    def rank(r):
        module = object.__new__(ShardedModule)
        module.rank, module.run_dir, module.train_step = r, str(tmp_path), None
        module.save(str(tmp_path / "checkpoints"), 7, {}, None, "tokenizer.model", is_main=r == 0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert events[:2] == ["slices 0", "slices 1"] and events[2:] == ["state.json", "latest step_000007"]


def test_the_readme_says_what_has_run_where():
    """Near the top: nothing has run on an accelerator, and the command that is the first run there exists."""
    with open(README, encoding="utf-8") as f:
        top = f.read()[:4000]
    assert "| | CPU | Ascend / GPU |" in top
    assert "nothing yet: no mindlab code has been compiled or run on an accelerator; `make device-check`" in top
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        assert "\ndevice-check:" in f.read()
