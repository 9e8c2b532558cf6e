"""benchmarks/device_check.py on any machine: its one line where there is no accelerator, its commands (composed
and validated as an 8-device Ascend node would validate them), and its report and verdict over fake device results;
and scripts/gpu_runtime.py, which `make device-check` runs it through: the CUDA 11 / cuDNN 8 wheels and the library
path MindSpore's GPU plugin needs, checked against what the plugin links. The checks themselves run only on an
accelerator."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig

import mindspore
import pytest

import base.validate
from base.validate import validate
from benchmarks import device_check as dc
from conftest import ROOT, compose_cfg


def test_without_an_accelerator_it_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(base.validate, "devices_here", lambda target: 0)  # any machine, as one without a device
    assert dc.main([]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        "device check: this machine has no Ascend or GPU device MindSpore can use; run it on the accelerator machine "
        "(on CPU, make test checks everything)"]


@pytest.mark.parametrize("check", ["pretrain", "sft+lora", "dp2xtp2xpp2"])
@pytest.mark.parametrize("device", ["ascend910b", "h100", "cpu"])
def test_its_commands_pass_validation(check, device, tmp_path, monkeypatch, base_checkpoint):
    monkeypatch.setattr(base.validate, "devices_here", lambda target: 8)
    overrides = dc.train_overrides(check, device, "auto", 50, str(tmp_path / "run"), str(tmp_path), base_checkpoint)
    cfg = compose_cfg(*[o for o in overrides if not o.startswith("hydra.")])
    p = cfg.parallel
    validate(cfg, world_size=p.dp * p.tp * p.pp)
    assert cfg.precision.compute_dtype == {"ascend910b": "bf16", "h100": "bf16", "cpu": "fp32"}[device]
    assert (p.dp, p.tp, p.pp) == ((2, 2, 2) if check == "dp2xtp2xpp2" and device != "cpu" else (1, 1, 1))
    if check == "dp2xtp2xpp2":  # the CPU reference takes the layout's global batch on one device
        rows = cfg.trainer.micro_batch_size * p.dp * (p.micro_batches if p.pp > 1 else 1)
        assert rows == dc.MICRO_BATCH * 4


def test_read_metrics_leaves_the_compiling_interval_out_of_the_speed(tmp_path):
    rows = [{"step": 10, "loss": 7.0, "tokens_per_sec": 100.0, "mfu": 0.01, "peak_device_memory_gb": 1.0},
            {"step": 20, "loss": 6.0, "tokens_per_sec": 1000.0, "mfu": 0.10, "peak_device_memory_gb": 1.5},
            {"step": 20, "val_loss": 6.1},
            {"step": 30, "loss": 5.5, "tokens_per_sec": 3000.0, "mfu": 0.30, "peak_device_memory_gb": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert dc.read_metrics(str(tmp_path)) == {"loss": 5.5, "step": 30, "tokens_per_s": 2000.0,
                                              "mfu": pytest.approx(0.2), "peak_memory_gb": 1.5}


def test_the_greedy_agreement_counts_leading_tokens():
    assert dc.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]) == "5 of 6"


class FakeMachine:
    """An 8-device Ascend node whose runs write what a real one would: metrics.jsonl (the device's loss `off`
    relative to CPU's), the generation worker's JSON; `fail` names a run whose process fails."""

    def __init__(self, off=0.01, fail=None):
        self.off, self.fail, self.commands = off, fail, []

    def run(self, command, log):
        self.commands.append(command)
        if self.fail and any(self.fail in part for part in command):
            return "config error: something went wrong"
        if "--generate-worker" in command:
            on_cpu = command[command.index("--target") + 1] == "CPU"
            tokens = [[1, 2, 3, 4]] * 4 if on_cpu else [[1, 2, 3, 9]] * 4
            with open(command[command.index("--out") + 1], "w") as f:
                json.dump({"tokens": tokens, "steps": 4, "tokens_per_s": 50.0,
                           "peak_memory_gb": None if on_cpu else 0.5}, f)
            return None
        run_dir = next(part.split("=", 1)[1] for part in command if part.startswith("hydra.run.dir="))
        loss = 5.0 if run_dir.endswith("-cpu") else 5.0 * (1 + self.off)
        os.makedirs(run_dir, exist_ok=True)
        rows = [{"step": s, "loss": loss, "tokens_per_sec": 1e4, "mfu": 0.2, "peak_device_memory_gb": 2.0}
                for s in (10, 20)]
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        return None


def _check_on(machine, monkeypatch, tmp_path, capsys, *argv):
    monkeypatch.setattr(dc, "accelerator", lambda: "Ascend")
    monkeypatch.setattr(base.validate, "devices_here", lambda target: 8)
    monkeypatch.setattr(dc, "run", machine.run)
    code = dc.main(["--workdir", str(tmp_path), *argv])
    return code, capsys.readouterr().out.splitlines()


def test_a_good_device_run_reports_every_check_and_passes(monkeypatch, tmp_path, capsys):
    machine = FakeMachine(off=0.01)
    code, lines = _check_on(machine, monkeypatch, tmp_path, capsys)
    assert code == 0
    assert lines[0] == "device check: 8 x ascend910b, compute bf16; reference: the same runs on CPU in fp32"
    rows = {line.split()[0]: line for line in lines[2:6]}
    assert list(rows) == ["pretrain", "sft+lora", "generate", "dp2xtp2xpp2"]
    for name in ("pretrain", "sft+lora", "dp2xtp2xpp2"):
        assert rows[name].split()[1:] == ["20", "10,000", "20.0%", "2.00", "GiB", "5.0500", "5.0000", "1.00%", "ok"]
    assert rows["generate"].endswith("greedy tokens agree with CPU fp32: 12 of 16")
    assert lines[6] == "verdict: every check ran, losses within 5% of CPU fp32"
    pretrain = next(c for c in machine.commands if "hydra.run.dir=" + str(tmp_path / "pretrain-ascend910b") in c)
    assert pretrain[:2] == [sys.executable, os.path.join(dc.ROOT, "train.py")] and "device=ascend910b" in pretrain


def test_a_loss_off_by_more_than_the_tolerance_fails(monkeypatch, tmp_path, capsys):
    code, lines = _check_on(FakeMachine(off=0.08), monkeypatch, tmp_path, capsys)
    assert code == 1
    assert lines[2].startswith("pretrain") and lines[2].endswith("8.00%  loss off by more than 5%")
    assert lines[6].startswith("verdict: FAILED") and lines[7] == f"runs: {tmp_path}"


def test_a_check_that_does_not_run_is_named_with_its_last_line(monkeypatch, tmp_path, capsys):
    code, lines = _check_on(FakeMachine(fail="dp2tp2pp2"), monkeypatch, tmp_path, capsys)
    assert code == 1
    layout = next(line for line in lines if line.startswith("dp2xtp2xpp2"))
    assert layout.endswith("FAILED: config error: something went wrong")


def test_an_unknown_device_preset_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(dc, "accelerator", lambda: "GPU")
    assert dc.main(["--device", "h200", "--workdir", str(tmp_path)]) == 2
    assert "--device: no preset 'h200' in conf/device/; choose one of a100, ascend910b, cpu, h100" in \
        capsys.readouterr().err


def test_generation_is_checked_against_the_same_checkpoint_and_fails_when_it_disagrees(monkeypatch, tmp_path, capsys):
    """Both greedy runs read the device's own pretrained checkpoint (a CPU checkpoint's tokens would differ for any
    device whose training differs); agreement under --min-agreement fails the check."""
    machine = FakeMachine(off=0.01)
    code, lines = _check_on(machine, monkeypatch, tmp_path, capsys, "--min-agreement", "0.8")
    assert code == 1
    generate = next(line for line in lines if line.startswith("generate"))
    assert generate.endswith("greedy tokens agree with CPU fp32: 12 of 16, fewer than 80%")
    workers = [c for c in machine.commands if "--generate-worker" in c]
    assert {c[c.index("--generate-worker") + 1] for c in workers} == {str(tmp_path / "pretrain-ascend910b")}
    assert {c[c.index("--target") + 1] for c in workers} == {"Ascend", "CPU"}


def test_the_layout_check_starts_both_runs_from_the_same_weights(monkeypatch, tmp_path, capsys):
    """A sharded build initialises its weights on the device at random: the dp2xtp2xpp2 run and its CPU reference
    both start from the CPU pretraining's checkpoint, so their losses can agree."""
    machine = FakeMachine(off=0.01)
    assert _check_on(machine, monkeypatch, tmp_path, capsys)[0] == 0
    layout_runs = [c for c in machine.commands if any(part.startswith("hydra.run.dir=") and "dp2xtp2xpp2" in part
                                                      for part in c)]
    assert len(layout_runs) == 2
    assert all(f"stage.init_from={tmp_path / 'pretrain-cpu'}" in c for c in layout_runs)


# --- scripts/gpu_runtime.py: what make device-check installs on a GPU host --------------------------------------

spec = importlib.util.spec_from_file_location("gpu_runtime", os.path.join(ROOT, "scripts", "gpu_runtime.py"))
gpu_runtime = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_runtime)
PLUGIN = os.path.join(os.path.dirname(mindspore.__file__), "lib", "plugin", "libmindspore_gpu.so.11.6")


def test_the_wheels_provide_every_library_the_gpu_plugin_links_but_the_drivers():
    """ldd of MindSpore's GPU plugin: every library it links that this machine lacks is one the pinned wheels bring,
    or the driver's libcuda.so.1 (on a GPU host after make device-check, with LD_LIBRARY_PATH set: the driver's
    alone, or none)."""
    if not os.path.exists(PLUGIN):
        pytest.skip(f"{PLUGIN} is absent: this MindSpore package has no GPU plugin")
    lines = subprocess.run(["ldd", PLUGIN], capture_output=True, text=True, check=True).stdout.splitlines()
    linked = {line.split()[0] for line in lines if "=>" in line}
    missing = {line.split()[0] for line in lines if "not found" in line}
    assert set(gpu_runtime.LIBRARIES) | {gpu_runtime.DRIVER} <= linked
    assert missing <= set(gpu_runtime.LIBRARIES) | {gpu_runtime.DRIVER}
    assert {wheel for wheel, _ in gpu_runtime.LIBRARIES.values()} == set(gpu_runtime.pinned())
    assert gpu_runtime.pinned()["nvidia-cudnn-cu11"].startswith("8.")  # libcudnn.so.8: 9.x ships libcudnn.so.9


def test_the_library_path_is_each_wheels_lib_dir_in_the_venv_before_the_existing_path():
    site = sysconfig.get_paths()["purelib"]
    env = gpu_runtime.environment({"LD_LIBRARY_PATH": "/opt/mine"})
    dirs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert dirs[-1] == "/opt/mine" and dirs[:-1] == [os.path.join(site, "nvidia", folder, "lib") for folder in
                                                       ("cublas", "cudnn", "cuda_runtime", "cusolver", "cufft",
                                                        "curand", "cusparse", "cuda_nvrtc")]
    assert gpu_runtime.environment({})["LD_LIBRARY_PATH"] == os.pathsep.join(dirs[:-1])


def test_with_a_driver_it_installs_once_then_runs_the_command_on_the_library_path(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_runtime, "has_driver", lambda: True)
    monkeypatch.setattr(gpu_runtime.sys, "prefix", str(tmp_path))
    pip, ran = [], []
    monkeypatch.setattr(gpu_runtime.subprocess, "run", lambda cmd, check: pip.append(cmd))
    monkeypatch.setattr(gpu_runtime.os, "execvpe", lambda file, args, env: ran.append((file, args, env)))
    for _ in range(2):
        gpu_runtime.main(["python", "-m", "benchmarks.device_check"])
    assert pip == [[sys.executable, "-m", "pip", "install", "-q", "-r", gpu_runtime.REQUIREMENTS]]  # once
    assert [(f, a) for f, a, _ in ran] == [("python", ["python", "-m", "benchmarks.device_check"])] * 2
    assert ran[0][2]["LD_LIBRARY_PATH"].startswith(gpu_runtime.library_path()[0] + os.pathsep)


def test_without_a_driver_the_command_runs_as_it_is_and_gpu_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu_runtime, "has_driver", lambda: False)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    ran = []
    monkeypatch.setattr(gpu_runtime, "install", lambda: pytest.fail("installed without a driver"))
    monkeypatch.setattr(gpu_runtime.os, "execvpe", lambda file, args, env: ran.append(env))
    gpu_runtime.main(["true"])
    assert "LD_LIBRARY_PATH" not in ran[0]
    assert gpu_runtime.main(["--gpu", "true"]) == 1 and len(ran) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "gpu runtime: no NVIDIA driver on this machine (libcuda.so.1 is not on the loader's path and "
        "/proc/driver/nvidia is absent): install the driver first; the CUDA libraries come from the venv"]


def test_make_device_check_runs_the_device_check_through_it():
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    recipe = makefile.split("\ndevice-check:", 1)[1].splitlines()[1].strip()
    assert recipe == "scripts/venv.sh python scripts/gpu_runtime.py python -m benchmarks.device_check"
