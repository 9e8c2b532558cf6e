"""Checkpoints you can trust: exact resume after SIGTERM or SIGKILL, damaged checkpoints, NaN skipping."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import load_preset, train_main
from helpers import finish, losses, run_in_process, start, wait_for_step, weights
from models import build_model
from base import checkpoint

# model=tiny cut to one layer: what a checkpoint holds and how a run resumes do not depend on the depth, and each
# of the file's training runs compiles its graphs in about half the time
ONE_LAYER = "model.num_layers=1"


def launch(run_dir, env=None):
    """helpers.start's run, as a process: the runs that get a signal."""
    return start(run_dir, ONE_LAYER, env=env)


def in_process(run_dir, monkeypatch, *overrides):
    """`launch`'s command line as train.py's main in this process: the runs that need no signal."""
    return run_in_process(run_dir, monkeypatch, ONE_LAYER, *overrides)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("a") / "run")
    with pytest.MonkeyPatch.context() as mp:
        code, _, err = in_process(run_dir, mp)
    assert code == 0, err[-2000:]
    return run_dir


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resume_is_bit_exact(uninterrupted, tmp_path, monkeypatch):
    """The signalled run goes through MindSpore's default pipeline, as a user's run does (conftest.py runs the suite
    host-blocking): the steps it trained equal the host-blocking runs' bit for bit."""
    run_dir = str(tmp_path / "run")
    proc = launch(run_dir, env=dict(os.environ, MS_DEV_HOST_BLOCKING_RUN="0"))
    wait_for_step(run_dir, 9, proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 0, err[-2000:]
    assert "SIGTERM: saved step" in out
    stopped = max(losses(run_dir))
    assert stopped < 24
    run_id = json.load(open(os.path.join(run_dir, "checkpoints", f"step_{stopped:06d}", "state.json")))["run_id"]

    code, out, err = in_process(run_dir, monkeypatch)  # the same command resumes (trainer.resume=auto)
    assert code == 0, err[-2000:]
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:06d} at step {stopped} (run id {run_id})" in out
    ref, got = losses(uninterrupted), losses(run_dir)
    assert sorted(got) == list(range(1, 25))  # the metrics file reads as one run
    assert [got[s] for s in range(1, 25)] == [ref[s] for s in range(1, 25)]  # bit-exact, every step
    final = "checkpoints/step_000024"
    a, b = weights(os.path.join(uninterrupted, final)), weights(os.path.join(run_dir, final))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert json.load(open(os.path.join(run_dir, final, "state.json")))["run_id"] == run_id


@pytest.mark.slow
def test_sigkill_mid_run_resumes_from_the_last_checkpoint_and_matches(uninterrupted, tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    proc = launch(run_dir)
    wait_for_step(run_dir, 10, proc)
    proc.kill()
    proc.wait()
    code, out, err = in_process(run_dir, monkeypatch)
    assert code == 0, err[-2000:]
    assert "resumed from" in out
    ref, got = losses(uninterrupted), losses(run_dir)
    assert [got[s] for s in range(1, 25)] == [ref[s] for s in range(1, 25)]


@pytest.mark.slow  # reads a real training run's output (a module fixture)
def test_retention_keeps_the_newest_and_the_latest_pointer(uninterrupted):
    root = os.path.join(uninterrupted, "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_000016", "step_000020", "step_000024"]
    assert open(os.path.join(root, "latest")).read().strip() == "step_000024"


@pytest.mark.slow  # reads a real training run's output (a module fixture)
def test_damaged_newest_checkpoint_is_reported_and_the_previous_used(uninterrupted, tmp_path):
    root = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(uninterrupted, "checkpoints"), root)
    os.makedirs(os.path.join(root, "step_000028.tmp-999"))  # a save killed before its rename
    with open(os.path.join(root, "step_000024", "optimizer.safetensors"), "r+b") as f:
        f.truncate(100)  # a disk that lost the end of a file
    reports = []
    assert checkpoint.latest_intact(root, log=reports.append) == os.path.join(root, "step_000020")
    assert "step_000024/optimizer.safetensors: 100 bytes" in reports[0] and "truncated" in reports[0]


@pytest.mark.slow  # reads a real training run's output (a module fixture)
def test_checkpoint_of_another_shape_or_vocab_is_refused_naming_the_tensor(uninterrupted):
    ckpt = os.path.join(uninterrupted, "checkpoints", "step_000024")
    run_model = OmegaConf.merge(load_preset("model", "tiny"), {"num_layers": 1})
    wider = build_model(OmegaConf.merge(run_model, {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 2}), 16, "fp32",
                        "CPU", 0)
    with pytest.raises(checkpoint.CheckpointError, match=r"model.tok_embeddings.embedding_weight has shape "
                                                         r"\(4096, 128\) but this model needs \(4096, 64\)"):
        checkpoint.load_weights(ckpt, wider)
    other_vocab = build_model(OmegaConf.merge(run_model, {"vocab_size": 8192}), 16, "fp32", "CPU", 0)
    with pytest.raises(checkpoint.CheckpointError, match=r"\(4096, 128\) but this model needs \(8192, 128\)"):
        checkpoint.load_weights(ckpt, other_vocab)


def test_unreadable_checkpoint_file_gives_one_clear_error(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"not a checkpoint")
    model = build_model(load_preset("model", "tiny"), 16, "fp32", "CPU", 0)
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors: cannot be read"):
        checkpoint.load_weights(str(bad), model)


@pytest.mark.slow
def test_injected_nan_is_skipped_logged_and_training_recovers(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    code, _, err = in_process(run_dir, monkeypatch, "trainer.max_steps=12", "trainer.inject_nan_steps=[5,6]")
    assert code == 0, err[-2000:]
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    skips = [m for m in lines if "skipped" in m]
    assert [(m["step"], m["skipped"]) for m in skips] == [(5, "non-finite loss"), (6, "non-finite loss")]
    assert skips[0]["data_position"] == 4 * 8  # samples this rank had consumed before step 5
    after = [m for m in lines if "loss" in m and "skipped" not in m]
    assert all(np.isfinite(m["loss"]) for m in after) and after[-1]["skipped_steps"] == 2
    assert after[-1]["loss"] < after[0]["loss"]


@pytest.mark.slow
def test_too_many_consecutive_skips_stop_with_a_message_and_a_checkpoint(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    code, _, err = in_process(run_dir, monkeypatch, "trainer.max_steps=12", "trainer.inject_nan_steps=[3,4,5]",
                              "trainer.max_consecutive_skips=3")
    assert code == 1
    assert "3 consecutive steps skipped (last: non-finite loss); stopping" in err
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "step_000005"))


def _tiny_checkpoints(root, steps):
    """Real checkpoints of a tiny model at `steps` under `root` (the run's checkpoints/), SGD state."""
    import mindspore as ms

    from conftest import compose_cfg

    cfg = compose_cfg("model=tiny")
    model = build_model(cfg.model, 16, "fp32", "CPU", seed=0)
    optimizer = ms.nn.SGD(model.trainable_params())
    return model, optimizer, cfg, [checkpoint.save(str(root), s, model, optimizer, {}, cfg) for s in steps]


def test_a_checkpoint_argument_may_be_the_run_its_checkpoints_latest_or_a_step(tmp_path):
    run = tmp_path / "run"
    *_, (first, second) = _tiny_checkpoints(run / "checkpoints", [2, 4])
    for given in (run, run / "checkpoints", run / "checkpoints" / "latest", second):
        assert checkpoint.resolve(str(given)) == second
    assert checkpoint.resolve(first) == first
    assert checkpoint.weights_file(str(run)) == os.path.join(second, checkpoint.WEIGHTS)


def test_a_dangling_latest_names_the_step_and_the_newest_intact_one(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    *_, (first, second) = _tiny_checkpoints(root, [2, 4])
    shutil.rmtree(second)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.resolve(str(tmp_path / "run"))
    assert str(err.value) == (f"{root}/latest: points at step_000004, which is gone (deleted or pruned); the newest "
                              f"intact checkpoint is {first}: give that one (trainer.resume=auto resumes from it)")


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    """What safetensors raises on a full device (measured on a 1 MB tmpfs: 'I/O error: No space left on device (os
    error 28)'), injected into the second save: one DiskFull line naming the directory and the bytes, the partial
    directory removed, the first checkpoint and `latest` untouched."""
    import mindspore as ms

    from base.errors import DiskFull

    root = tmp_path / "checkpoints"
    model, optimizer, cfg, (first,) = _tiny_checkpoints(root, [2])
    before = {name: open(os.path.join(first, name), "rb").read() for name in os.listdir(first)}

    class SafetensorError(Exception):
        pass

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ms, "save_checkpoint", full)
    with pytest.raises(DiskFull) as err:
        checkpoint.save(str(root), 4, model, optimizer, {}, cfg)
    needed = sum(p.size * 4 for p in model.get_parameters()) + sum(p.size * 4 for p in optimizer.parameters_dict().values()
                                                                   if p.name not in model.parameters_dict())
    message = str(err.value)
    assert message.startswith(f"{root}/step_000004.tmp-{os.getpid()}: no space left on the device (or over quota): "
                              f"the write needs about {needed / 1e6:.1f} MB and ")
    assert message.endswith("are free; the earlier checkpoints are intact (latest: step_000002); free space and run "
                            "again")
    assert sorted(os.listdir(root)) == ["latest", "step_000002"]
    assert {name: open(os.path.join(first, name), "rb").read() for name in os.listdir(first)} == before
    assert checkpoint.resolve(str(root)) == first


def test_a_real_full_filesystem_while_saving_is_the_same_one_line(tmp_path):
    """The same on a real 1 MB tmpfs, where this machine lets the test mount one."""
    from base.errors import DiskFull

    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        model, optimizer, cfg, _ = _tiny_checkpoints(tmp_path / "elsewhere", [])
        with pytest.raises(DiskFull, match="no space left on the device"):
            checkpoint.save(str(mount), 2, model, optimizer, {}, cfg)
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("steps, keep_last, keep_every, kept", [
    # by hand: the newest two (90, 100) and every multiple of 30 (30, 60, 90); the rest go
    (range(10, 101, 10), 2, 30, [30, 60, 90, 100]),
    (range(10, 101, 10), 3, 0, [80, 90, 100]),  # no milestones
    (range(10, 101, 10), 0, 30, list(range(10, 101, 10))),  # keep_last=0: nothing is pruned
    # past six digits the names no longer sort as the steps: the newest is still the newest
    ([999_990, 999_999, 1_000_000, 1_000_010], 2, 0, [1_000_000, 1_000_010]),
])
def test_prune_keeps_the_newest_and_every_milestone(tmp_path, steps, keep_last, keep_every, kept):
    """trainer.keep_last and trainer.keep_every as the loop prunes after each save (a bug here deletes milestones);
    a crashed save's temporary directory goes too."""
    for step in steps:
        (tmp_path / f"step_{step:06d}").mkdir()
    (tmp_path / "step_000110.tmp-1234").mkdir()
    checkpoint.prune(str(tmp_path), keep_last, keep_every)
    assert sorted(os.listdir(tmp_path), key=lambda n: int(n[5:])) == [f"step_{s:06d}" for s in kept]


FP16 = ["model=tiny", "data.seq_len=64", "trainer.micro_batch_size=4", "trainer.max_steps=8", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.save_every=4", "logger.progress_bar=false",
        "precision=fp16", "precision.init_scale=2097152", "precision.growth_interval=2", ONE_LAYER]


def logged(run_dir, key):
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {m["step"]: m[key] for m in lines if key in m}


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    """An fp16 run of 8 steps whose dynamic loss scale starts at 2^21: its first steps overflow fp16 and back off,
    the later ones grow it every 2 clean steps; and the same run resumed from its step-4 checkpoint in a new dir."""
    tmp = tmp_path_factory.mktemp("fp16")
    whole, resumed = str(tmp / "whole"), str(tmp / "resumed")
    with pytest.MonkeyPatch.context() as mp:
        code, _, err = train_main(tmp, mp, *FP16, f"hydra.run.dir={whole}")
        assert code == 0, err[-2000:]
        code, out, err = train_main(tmp, mp, *FP16, f"trainer.resume={whole}/checkpoints/step_000004",
                                    f"hydra.run.dir={resumed}")
        assert code == 0, err[-2000:]
    return whole, resumed, out


@pytest.mark.slow
def test_fp16_resume_restores_the_dynamic_loss_scale_and_matches_the_uninterrupted_run(fp16_runs):
    """The scale a checkpoint holds is the one the steps before it made, by hand: halve on an overflowing (skipped)
    step, double after 2 clean ones (trainer/step.py DynamicLossScale); the resumed run goes on from it, so its
    scales, losses and final weights are the uninterrupted run's, bit for bit."""
    whole, resumed, out = fp16_runs
    assert "resumed from" in out
    counted = logged(whole, "skipped_steps")  # the run's count of skipped steps after each step
    skipped = {s for s in range(1, 9) if counted[s] > counted.get(s - 1, 0)}
    assert skipped & {1, 2, 3} and 4 not in skipped  # backed off, then a clean step the checkpoint must count
    scale, clean = 2.0 ** 21, 0
    for step in range(1, 5):
        if step in skipped:
            scale, clean = max(scale / 2, 1.0), 0
        else:
            clean += 1
            if clean == 2:
                scale, clean = scale * 2, 0
    saved = json.load(open(os.path.join(whole, "checkpoints", "step_000004", "state.json")))["loss_scale"]
    assert saved == [scale, clean]
    assert logged(whole, "loss_scale")[4] == scale
    ref, got = logged(whole, "loss_scale"), logged(resumed, "loss_scale")
    assert [got[s] for s in range(5, 9)] == [ref[s] for s in range(5, 9)]
    assert [losses(resumed)[s] for s in range(5, 9)] == [losses(whole)[s] for s in range(5, 9)]
    final = "checkpoints/step_000008"
    a, b = weights(os.path.join(whole, final)), weights(os.path.join(resumed, final))
    assert all(np.array_equal(a[k], b[k]) for k in a)
