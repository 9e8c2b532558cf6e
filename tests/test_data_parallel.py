"""Data parallelism for real on CPU: `parallel=dp2` re-launches itself under msrun with 2 workers (mccl)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from conftest import ROOT, train_main

# model=tiny cut to one layer: what is checked (the launch, the replicas agreeing with one process) holds at any
# depth, and every process of a launch compiles less
COMMON = ["model.num_layers=1", "data.seq_len=64", "trainer.max_steps=6", "trainer.log_every=1",
          "optim.warmup_steps=2", "optim.lr=3e-3", "trainer.eval_batches=1", "logger.progress_bar=false"]


def train(run_dir, *overrides, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *COMMON, *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=os.path.dirname(run_dir), capture_output=True,
                          text=True, timeout=900, env=env)


def path_with_another_python(tmp_path):
    """The environment of a launch whose PATH holds another `python` (one without MindSpore) and not the venv:
    msrun starts its workers as `python train.py`, which must still be the interpreter that launched."""
    other = shutil.which("python3", path="/usr/bin:/bin")
    if other is None or subprocess.run([other, "-c", "import mindspore"], capture_output=True).returncode == 0:
        return None
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").symlink_to(other)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = f"{fake}:/usr/bin:/bin"
    return env


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in line]


def weights(run_dir):
    import mindspore as ms

    return ms.load_checkpoint(os.path.join(run_dir, "checkpoints", "step_000006", "model.safetensors"),
                              format="safetensors")


@pytest.mark.slow
def test_dp2_matches_one_process_on_the_same_global_batch(tmp_path, monkeypatch):
    """Same losses and weights as one process (train.py's main in this one); the launch's PATH holds another
    python, which the workers must not run (a `python` on PATH is what msrun starts)."""
    single, dp2 = str(tmp_path / "single"), str(tmp_path / "dp2")
    code, _, err = train_main(tmp_path, monkeypatch, *COMMON, "trainer.micro_batch_size=8",
                              f"hydra.run.dir={single}")
    assert code == 0, err[-2000:]
    proc = train(dp2, "parallel=dp2", "trainer.micro_batch_size=4", "trainer.grad_accum=1",
                 env=path_with_another_python(tmp_path))  # None (this environment) where no such python exists
    assert proc.returncode == 0 and "No module named" not in proc.stderr, proc.stderr[-3000:]
    np.testing.assert_allclose(losses(dp2), losses(single), atol=1e-5)
    digests = set()
    for worker in ("worker_0.log", "worker_1.log"):
        log = open(os.path.join(dp2, "workers", worker)).read()
        digests |= set(re.findall(r"weights sha256 ([0-9a-f]{64})", log))
    assert len(digests) == 1  # both replicas hold bit-identical weights after 6 steps
    # rank 0 alone writes the run's log and status: msrun's scheduler runs train.py too, as no rank
    assert open(os.path.join(dp2, "train.log")).read().count("run dir:") == 1
    assert "run dir:" not in open(os.path.join(dp2, "workers", "scheduler.log")).read()
    a, b = weights(single), weights(dp2)
    assert max(float(np.abs(a[k].asnumpy() - b[k].asnumpy()).max()) for k in a) < 1e-4


@pytest.mark.slow
def test_a_failing_worker_fails_the_launch_within_seconds(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *COMMON, "parallel=dp2",
                             "trainer.micro_batch_size=4", "trainer.max_steps=100000",
                             "trainer.eval_at_start=false", f"hydra.run.dir={run_dir}"],  # metrics: step 1 first
                            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 300
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    workers_and_scheduler = psutil.Process(proc.pid).children(recursive=True)
    ranks = {p.environ().get("MS_NODE_ID"): p for p in workers_and_scheduler
             if "train.py" in " ".join(p.cmdline()) and p.environ().get("MS_ROLE") == "MS_WORKER"}
    assert set(ranks) == {"0", "1"}, f"workers found: {sorted(ranks)}"
    if len(os.sched_getaffinity(0)) >= 2:  # msrun --bind_core: each worker on its own share of the CPUs
        cpus = [set(ranks[r].cpu_affinity()) for r in ("0", "1")]
        assert cpus[0] and cpus[1] and not cpus[0] & cpus[1], cpus
    ranks["1"].send_signal(signal.SIGKILL)  # mid-training
    killed = time.time()
    _, err = proc.communicate(timeout=120)
    print(f"launch exited {time.time() - killed:.1f} s after worker 1 was killed")
    assert proc.returncode == 1
    assert "stopped without finishing; stopped the other workers" in err and "worker_1.log" in err, err[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers_and_scheduler)


@pytest.mark.slow
def test_a_worker_error_is_shown_by_the_launch(tmp_path, monkeypatch):
    """The launch is train.py's main in this process (from the repo: msrun starts the workers as its script, the
    path the command gave); the workers are msrun's processes as ever."""
    code, _, err = train_main(ROOT, monkeypatch, *COMMON, "parallel=dp2", "trainer.micro_batch_size=4",
                              "trainer.resume=/no/such/ckpt", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 1
    assert "stopped without finishing" in err
    assert "error: trainer.resume: /no/such/ckpt is not a checkpoint directory" in err
    assert "no error message" not in err


def test_a_worker_death_msrun_saw_first_is_still_reported(tmp_path, monkeypatch, capsys):
    """msrun can end the job before the launch's watcher has seen the worker that died (a fast error on a busy
    box): the ranks that left a log but no done marker are reported with their last lines all the same."""
    from distributed import launch

    run_dir = tmp_path / "run"
    (run_dir / "workers").mkdir(parents=True)
    (run_dir / "workers" / "worker_1.log").write_text("[INFO] starting\nerror: trainer.resume: bad\n")
    msrun = f"import sys; open({launch._done_marker(str(run_dir), 0)!r}, 'w').close(); sys.exit(1)"  # rank 0 done
    monkeypatch.setattr(launch, "msrun_command", lambda *args: [sys.executable, "-c", msrun])
    assert launch.relaunch(2, str(run_dir)) == 1
    err = capsys.readouterr().err
    assert "worker 1 stopped without finishing" in err and "error: trainer.resume: bad" in err


def test_ranks_that_die_together_are_all_named_and_the_ones_stopped_are_not(tmp_path, monkeypatch, capsys):
    """A SIGKILLed worker can take longer to be seen dead than the peer its death aborted (CI saw only the
    peer named): every rank dead within the grace time is reported; a rank the launch itself stops is not."""
    from distributed import launch

    run_dir = tmp_path / "run"
    (run_dir / "workers").mkdir(parents=True)
    for rank in range(3):
        (run_dir / "workers" / f"worker_{rank}.log").write_text(f"rank {rank} log\n")
    msrun = ("import os, subprocess, sys, time\n"
             "procs = [subprocess.Popen([sys.executable, '-c', f'import time; time.sleep({t})'],\n"
             "                          env={**os.environ, 'MS_ROLE': 'MS_WORKER', 'MS_NODE_ID': str(rank)})\n"
             "         for rank, t in [(0, 3.2), (1, 3.0), (2, 60)]]\n"
             "time.sleep(60)\n")
    monkeypatch.setattr(launch, "msrun_command", lambda *args: [sys.executable, "-c", msrun])
    started = time.time()
    assert launch.relaunch(3, str(run_dir)) == 1
    assert time.time() - started < 30
    err = capsys.readouterr().err
    assert "worker 0, 1 stopped without finishing" in err, err
    assert "rank 0 log" in err and "rank 1 log" in err and "rank 2 log" not in err
