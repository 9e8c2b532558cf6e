"""Two nodes for real: the command docs/parallel.md gives ("Several nodes"), typed twice on this machine, node 1 in
its own network namespace joined to this one by a veth pair. Node 1 then does not own the master's address, as a
second machine would not: its msrun starts no scheduler and reaches node 0's over the link. One CPU worker a node,
one run dir both share. (Root makes the namespace; where it cannot be made the tests skip with the reason, and
fail under CI=true, which runs them.)"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from conftest import ROOT, absent, train_main

# model=tiny cut to one layer: what is checked (the launch, the replicas agreeing with one process) holds at any
# depth, and every process of a launch compiles less
COMMON = ["model.num_layers=1", "data.seq_len=64", "trainer.log_every=1", "optim.warmup_steps=2", "optim.lr=3e-3",
          "trainer.eval_batches=1", "logger.progress_bar=false"]
DP2 = ["parallel=dp2", "trainer.micro_batch_size=4", "trainer.grad_accum=1"]
# a subnet of this test process's own: two sessions on one machine (two CI runs) must not share an address
SUBNET = f"10.201.{1 + os.getpid() % 250}"
MASTER, NODE1 = f"{SUBNET}.1", f"{SUBNET}.2"


def _ip(*args, netns=None):
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


@pytest.fixture(scope="module")
def netns():
    """A network namespace holding NODE1, joined to this one's MASTER by a veth pair; removed at the end (with it
    goes the veth pair)."""
    name = f"mindlab-node1-{os.getpid()}"
    host_end, node_end = f"mlh{os.getpid() % 100000}", f"mln{os.getpid() % 100000}"
    try:
        if os.geteuid() != 0:
            raise OSError("making a network namespace needs root")
        _ip("netns", "add", name)
    except OSError as err:  # (FileNotFoundError: no `ip`)
        absent(f"no second node: {err}")
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
        _ip("link", "set", node_end, "netns", name)
        _ip("addr", "add", f"{MASTER}/24", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("addr", "add", f"{NODE1}/24", "dev", node_end, netns=name)
        _ip("link", "set", node_end, "up", netns=name)
        _ip("link", "set", "lo", "up", netns=name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        subprocess.run(["ip", "link", "delete", host_end], capture_output=True)  # gone with the namespace, or never made


def free_port():
    import socket

    with socket.socket() as s:
        s.bind((MASTER, 0))
        return s.getsockname()[1]


def start_node(netns, run_dir, rank, port, *overrides):
    """One node's `python train.py ... nodes=2 node_rank=R master_addr=MASTER hydra.run.dir=RUN_DIR` (node 1 in the
    namespace), in a session of its own."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *COMMON, *DP2, *overrides, "nodes=2",
           f"node_rank={rank}", f"master_addr={MASTER}", f"master_port={port}", f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(["ip", "netns", "exec", netns, *cmd] if rank == 1 else cmd, cwd=os.path.dirname(run_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_nodes(netns, run_dir, *overrides):
    """Both nodes, node 1 first (it waits for node 0's scheduler, as a node that boots sooner does)."""
    port = free_port()
    node1 = start_node(netns, run_dir, 1, port, *overrides)
    return [start_node(netns, run_dir, 0, port, *overrides), node1]


def finish(procs, timeout=240):
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
    return outs


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in line]


@pytest.fixture(scope="module")
def runs(netns, tmp_path_factory):
    """The two-node run of 6 steps (a checkpoint at 3 and 6) and one process on the same global batch."""
    tmp = tmp_path_factory.mktemp("nodes")
    shared = str(tmp / "shared")
    procs = start_nodes(netns, shared, "trainer.max_steps=6", "trainer.save_every=3")
    (out0, err0), (out1, err1) = finish(procs)
    single = str(tmp / "single")
    mp = pytest.MonkeyPatch()
    try:
        code, _, err = train_main(tmp, mp, *COMMON, "trainer.max_steps=6", "trainer.micro_batch_size=8",
                                  f"hydra.run.dir={single}")
    finally:
        mp.undo()
    assert code == 0, err[-2000:]
    return {"shared": shared, "single": single, "codes": [p.returncode for p in procs],
            "out": [out0, out1], "err": [err0, err1]}


@pytest.mark.slow
def test_two_nodes_train_as_one_process_on_the_same_global_batch(runs):
    """As the one-node dp2 test: the losses and the final weights of one process at micro-batch 8."""
    import mindspore as ms

    assert runs["codes"] == [0, 0], "\n".join(runs["err"])[-3000:]
    np.testing.assert_allclose(losses(runs["shared"]), losses(runs["single"]), atol=1e-5)
    assert len(losses(runs["shared"])) == 6
    digests = set()
    for node in (0, 1):
        log = open(os.path.join(runs["shared"], "workers", f"node{node}", f"worker_{node}.log")).read()
        digests |= set(re.findall(r"weights sha256 ([0-9a-f]{64})", log))
    assert len(digests) == 1  # both replicas, one on each node, hold bit-identical weights

    def weights(run_dir):
        return ms.load_checkpoint(os.path.join(run_dir, "checkpoints", "step_000006", "model.safetensors"),
                                  format="safetensors")

    a, b = weights(runs["single"]), weights(runs["shared"])
    assert max(float(np.abs(a[k].asnumpy() - b[k].asnumpy()).max()) for k in a) < 1e-4


@pytest.mark.slow
def test_a_checkpoint_is_written_once_and_latest_moves_last(runs):
    """Rank 0 alone writes each checkpoint (a replica's weights are the run's), into the shared dir; `latest` names
    the last one and was written after every file of it."""
    root = os.path.join(runs["shared"], "checkpoints")
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    assert steps == ["step_000003", "step_000006"]
    for step in steps:
        files = os.listdir(os.path.join(root, step))
        assert files.count("model.safetensors") == 1 and not [f for f in files if f.startswith("rank_")], files
    assert open(os.path.join(root, "latest")).read().strip() == "step_000006"
    written = [os.stat(os.path.join(root, "step_000006", f)).st_mtime_ns for f in os.listdir(os.path.join(root, "step_000006"))]
    assert os.stat(os.path.join(root, "latest")).st_mtime_ns >= max(written)
    assert json.load(open(os.path.join(runs["shared"], "status.json")))["status"] == "finished"


@pytest.mark.slow
def test_each_nodes_console_is_mindlabs(runs):
    """No MindSpore C++ `[INFO]` lines, no msrun traceback; node 0 prints the run, node 1 only its launch; neither
    node started a second scheduler (node 1 does not own the master's address)."""
    for node in (0, 1):
        console = runs["out"][node] + runs["err"][node]
        assert "[INFO]" not in console and "Traceback" not in console, console[-3000:]
        assert runs["err"][node] == ""
    assert "step 6: val_loss" in runs["out"][0]
    assert os.path.exists(os.path.join(runs["shared"], "workers", "node0", "scheduler.log"))
    assert not os.path.exists(os.path.join(runs["shared"], "workers", "node1", "scheduler.log"))


def wait_for_training(run_dir, procs, timeout=300):
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + timeout
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
        time.sleep(0.2)


@pytest.mark.slow
def test_a_node_whose_worker_is_killed_ends_both_with_one_line(netns, tmp_path):
    """Node 1's worker SIGKILLed mid-training: node 1's launch names it (and its log), node 0's launch names node 1
    and stops its own worker instead of waiting in the broken collective; both exit 1, no traceback."""
    run_dir = str(tmp_path / "shared")
    procs = start_nodes(netns, run_dir, "trainer.max_steps=100000", "trainer.eval_at_start=false")  # step 1 first
    wait_for_training(run_dir, procs)
    workers = [p for p in psutil.Process(procs[1].pid).children(recursive=True)
               if p.environ().get("MS_ROLE") == "MS_WORKER" and "train.py" in " ".join(p.cmdline())]
    assert [p.environ().get("MS_NODE_ID") for p in workers] == ["1"]
    workers[0].send_signal(signal.SIGKILL)
    (out0, err0), (out1, err1) = finish(procs, timeout=120)
    assert [p.returncode for p in procs] == [1, 1]
    assert "[launch] worker 1 stopped without finishing" in err1 and "worker_1.log" in err1, err1[-3000:]
    launch_lines = [line for line in err0.splitlines() if line.strip()]
    assert launch_lines == ["[launch] node 1 failed: worker 1 stopped without finishing; see "
                            f"{os.path.join(run_dir, 'workers', 'node1')}; stopped this node's workers"], err0[-3000:]
    for console in (out0, err0, out1, err1):
        assert "Traceback" not in console and "[INFO]" not in console


@pytest.mark.slow
def test_a_node_that_fails_before_launching_ends_the_other_with_one_line(netns, tmp_path):
    """Node 0's launch has started when node 1's command, with a bad override, fails composing its config: node 1
    says so in its one line and leaves it as its `failed` marker; node 0 stops its workers and ends with one line
    naming node 1 and that reason, instead of waiting for node 1's worker until msrun's cluster timeout (600 s, past
    `finish`'s limit)."""
    run_dir = str(tmp_path / "shared")
    port = free_port()
    node0 = start_node(netns, run_dir, 0, port, "trainer.max_steps=100000")
    alive = os.path.join(run_dir, "workers", "node0", "alive")
    deadline = time.time() + 120
    while not os.path.exists(alive):  # node 0's launch began (msrun starts next)
        assert time.time() < deadline and node0.poll() is None, node0.communicate()[1][-2000:]
        time.sleep(0.1)
    node1 = start_node(netns, run_dir, 1, port, "trainer.max_stepz=6")
    (out0, err0), (out1, err1) = finish([node0, node1], timeout=120)
    assert [node0.returncode, node1.returncode] == [1, 2], err0[-2000:] + err1[-2000:]
    reason = err1.strip()
    assert reason.startswith("config error: ") and "trainer.max_stepz" in reason and "\n" not in reason, err1
    assert [line for line in err0.splitlines() if line.strip()] == [
        f"[launch] node 1 failed: before launching: {reason}; stopped this node's workers"], err0[-3000:]
    for console in (out0, err0, out1):
        assert "Traceback" not in console and "[INFO]" not in console


def test_a_node_started_after_another_failed_starts_no_workers(tmp_path, monkeypatch, capsys):
    """Node 1 failed before launching, shortly before node 0's launch began: node 0 names it in one line and starts
    no msrun (the real one started here would wait for node 1 until its cluster timeout)."""
    from distributed import launch

    launch.write_failed(launch.Nodes(2, 1), str(tmp_path), "before launching: config error: a bad override")
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *args, **kwargs: pytest.fail("msrun started"))
    assert launch.relaunch(2, str(tmp_path), nodes=2, node_rank=0, master_addr=MASTER, master_port=1) == 1
    assert capsys.readouterr().err == ("[launch] node 1 failed: before launching: config error: a bad override; "
                                       "started no workers on this node\n")


def test_a_loopback_master_addr_is_refused_in_one_line_and_told_to_the_other_nodes(tmp_path, monkeypatch):
    """On another machine 127.0.0.1 (or localhost) is that machine: node 1's msrun would start a scheduler of its
    own. Refused before anything starts, in one line naming master_addr and the fix; the refusing node's `failed`
    marker says it to the other nodes."""
    run_dir = tmp_path / "shared"
    for addr in ("127.0.0.1", "localhost"):
        code, _, err = train_main(tmp_path, monkeypatch, *COMMON, *DP2, "nodes=2", "node_rank=1",
                                  f"master_addr={addr}", f"hydra.run.dir={run_dir}")
        assert code == 2 and err.strip() == (
            f"config error: master_addr: {addr} is a loopback address, which the other nodes cannot reach: give "
            "node 0's address on the network the nodes share (e.g. the first of `hostname -I` on node 0); the workers "
            "of one machine run without nodes="), err
        assert (run_dir / "workers" / "node1" / "failed").read_text() == f"before launching: {err.strip()}\n"
        assert not (run_dir / "workers" / "node1" / "msrun.log").exists()


def test_the_other_nodes_are_watched_through_the_shared_run_dir(tmp_path):
    """What a node's launch sees of the others, without launching: a `failed` marker written during this launch, or
    shortly before it (a node that failed before launching), is named at once, one left by an earlier launch is
    not; a node whose `alive` file stops changing is gone after PEER_TIMEOUT_SECONDS of this node's clock (a fake
    one here), unless its ranks all finished."""
    from distributed import launch

    three = [launch.Nodes(3, r) for r in range(3)]
    launch.write_failed(three[1], str(tmp_path / "before"), "before launching: config error: a bad override")
    os.makedirs(three[0].log_dir(str(tmp_path / "before")))
    assert launch.Peers(three[0], str(tmp_path / "before"), 3).gone() == \
        "node 1 failed: before launching: config error: a bad override"
    run_dir = str(tmp_path)
    for node in three:
        os.makedirs(node.log_dir(run_dir), exist_ok=True)
    launch.write_failed(three[2], run_dir, "worker 2 stopped without finishing; see an earlier launch")
    earlier = time.time() - launch.START_SKEW_SECONDS - 1
    os.utime(os.path.join(three[2].log_dir(run_dir), "failed"), (earlier, earlier))
    peers = launch.Peers(three[0], run_dir, 3)
    now = [100.0]
    peers.clock = lambda: now[0]
    assert peers.gone() is None  # node 2's marker predates this launch; node 1 has not started
    node1 = launch.Peers(three[1], run_dir, 3)  # starts again: its own marker goes, its alive file comes
    assert peers.gone() is None  # first sight of node 1's alive file: the clock starts at 100
    now[0] += launch.PEER_TIMEOUT_SECONDS - 1
    os.utime(node1._file(1, "alive"), ns=(1, 1))  # node 1 touched it again (another mtime): the clock restarts
    assert peers.gone() is None
    now[0] += launch.PEER_TIMEOUT_SECONDS
    assert peers.gone() is None  # exactly the timeout since the change: not yet
    now[0] += 0.5
    assert peers.gone() == f"node 1's launch stopped answering (no sign of life for {launch.PEER_TIMEOUT_SECONDS:g} s)"
    launch.mark_done(run_dir, 1)  # node 1's only rank finished: its launch may end before ours
    assert peers.gone() is None
    launch.Peers(three[2], run_dir, 3).fail("worker 2 stopped without finishing; see workers/node2")
    assert peers.gone() == "node 2 failed: worker 2 stopped without finishing; see workers/node2"
