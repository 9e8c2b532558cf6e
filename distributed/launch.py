"""Start a multi-process layout on this machine: `python train.py parallel=dp2` re-runs itself under msrun.

Every worker gets the same command line plus the parent's Hydra run dir, so all ranks share one run dir;
msrun writes one log per worker to <run dir>/workers/. The launch fails (non-zero) as soon as any worker
fails: a watchdog polls the workers and, when one is gone without having marked itself done, kills the
rest, msrun and its scheduler (msrun alone kills the workers within a second but then waits ~30 s for
its scheduler's heartbeat timeout), and prints the log tail of every worker that died within half a
second of the first.

Across nodes (`nodes=N node_rank=r master_addr=HOST hydra.run.dir=SHARED`, the same command on every node; README,
scripts/slurm_msrun.sbatch), each node's train.py starts its own msrun with that node's share of the workers,
pointed at node 0's scheduler; every rank writes into the one shared run dir, each node's worker logs go to
<run dir>/workers/node<r>/, and the watchdog here watches this node's workers and, through the shared run dir, the
other nodes: a node whose workers fail, or that fails before its launch starts (a bad override, an msrun that cannot
start: `told_to_other_nodes`), writes workers/node<r>/failed (its one-line reason), and a node whose launch is gone
(killed, the machine down) stops touching workers/node<r>/alive; either ends every other node's launch with one line
naming that node, instead of leaving its workers waiting in a collective, or for a scheduler that never comes, for
MindSpore's timeouts.

The console is mindlab's: msrun's own log (and the traceback it raises when a worker fails) goes to
<log dir>/msrun.log, and the `[INFO]` lines MindSpore's C++ log prints past GLOG_v at a worker's exit are dropped
from the worker logs msrun echoes.
"""
import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import psutil

from base.errors import error_line

POLL_SECONDS = 0.1  # msrun polls every 1 s and then kills the rest: see the first death first
GRACE_SECONDS = 0.5  # after the first death, how long other ranks may take to be seen dead too
# a node whose `alive` file has not changed for this long (by this node's clock, whatever the other's says) is gone;
# its launch touches the file every poll, and a shared file system may show a change several seconds late
PEER_TIMEOUT_SECONDS = 20.0
# a `failed` marker written up to this long before this node's launch began counts as this launch's: a node that fails
# before launching (a bad override) may do so before a node started a little later gets here; an earlier launch's
# marker is older than that (a relaunch after a failure takes longer) or gone (its node has started again)
START_SKEW_SECONDS = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Nodes:
    """Where this node's workers sit in the run: `count` nodes of equal shares, this one `rank`, node 0 at
    `master_addr`:`master_port`. One node: the local machine, a free port."""
    count: int = 1
    rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    def log_dir(self, run_dir: str) -> str:
        """msrun's worker logs and this node's python shim: its own folder when nodes share the run dir."""
        return os.path.join(run_dir, "workers", *([f"node{self.rank}"] if self.count > 1 else []))

    def ranks(self, workers: int) -> range:
        """The global ranks msrun starts on this node: node r holds [r * share, (r + 1) * share)."""
        share = workers // self.count
        return range(self.rank * share, (self.rank + 1) * share)


class Peers:
    """The other nodes of the run, seen through the shared run dir: this node's `alive` file is touched every poll,
    a failed node leaves `failed` with its reason. `gone()` names the first other node that failed or whose `alive`
    has stood still for PEER_TIMEOUT_SECONDS, unless its workers all finished (its launch ends before ours may)."""

    def __init__(self, nodes: Nodes, run_dir: str, workers: int):
        self.nodes, self.run_dir, self.workers = nodes, run_dir, workers
        self.seen: Dict[int, tuple] = {}  # node -> (alive's mtime, when this node saw it change)
        self.clock = time.monotonic  # this node's: the other nodes' clocks may differ from it
        if os.path.exists(self.failed_file(nodes.rank)):  # an earlier launch's into this run dir
            os.remove(self.failed_file(nodes.rank))
        self.touch()  # its mtime is the launch's start by the shared file system's clock, which the markers' share
        start = self._mtime(self._file(nodes.rank, "alive"))
        # the markers of an earlier launch into this run dir count once they change (that node has started again)
        self.earlier = {node: (self._stale(self._mtime(self.failed_file(node)), start),
                               self._mtime(self._file(node, "alive"))) for node in range(nodes.count)}

    @staticmethod
    def _stale(failed: Optional[int], start: int) -> Optional[int]:
        """A `failed` marker's mtime where it predates this launch by more than START_SKEW_SECONDS, else None (this
        launch's: that node failed before launching, shortly before this one got here)."""
        return failed if failed is not None and failed < start - START_SKEW_SECONDS * 1e9 else None

    @staticmethod
    def _mtime(path: str) -> Optional[int]:
        try:
            return os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return None

    def _file(self, node: int, name: str) -> str:
        return os.path.join(Nodes(self.nodes.count, node).log_dir(self.run_dir), name)

    def failed_file(self, node: int) -> str:
        return self._file(node, "failed")

    def touch(self) -> None:
        path = self._file(self.nodes.rank, "alive")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{time.time()}\n")

    def fail(self, reason: str) -> None:
        write_failed(self.nodes, self.run_dir, reason)

    def _finished(self, node: int) -> bool:
        return all(os.path.exists(_done_marker(self.run_dir, rank))
                   for rank in Nodes(self.nodes.count, node).ranks(self.workers))

    def gone(self) -> Optional[str]:
        now = self.clock()
        for node in range(self.nodes.count):
            if node == self.nodes.rank or self._finished(node):
                continue
            failed = self._mtime(self.failed_file(node))
            if failed is not None and failed != self.earlier[node][0]:
                with open(self.failed_file(node), encoding="utf-8", errors="replace") as f:
                    return f"node {node} failed: {f.read().strip()}"
            mtime = self._mtime(self._file(node, "alive"))
            if mtime is None or mtime == self.earlier[node][1]:  # not started (yet): msrun's cluster_time_out
                continue                                            # covers a node that never comes
            if self.seen.get(node, (None,))[0] != mtime:
                self.seen[node] = (mtime, now)
            elif now - self.seen[node][1] > PEER_TIMEOUT_SECONDS:
                return f"node {node}'s launch stopped answering (no sign of life for {PEER_TIMEOUT_SECONDS:g} s)"
        return None


def write_failed(node: Nodes, run_dir: str, reason: str) -> None:
    """workers/node<r>/failed: this node's one-line reason, which ends the other nodes' launches."""
    os.makedirs(node.log_dir(run_dir), exist_ok=True)
    with open(os.path.join(node.log_dir(run_dir), "failed"), "w", encoding="utf-8") as f:
        f.write(reason + "\n")


def msrun_command(workers: int, run_dir: str, script: str, overrides: List[str], nodes: Nodes = Nodes()) -> List[str]:
    """msrun run by this interpreter (not whichever `msrun` is first on PATH).

    `--bind_core=True`: msrun starts each worker under `taskset` on its own share of this process's CPUs (on
    Ascend, the CPUs nearest its device). Unbound, the workers' threads share every CPU, and MindSpore's threads
    pass each kernel launch between them across busy CPUs: parallel=dp2 of model=tiny on 2 cores ran 9,900
    tokens/s unbound and 12,300 bound (medians of four and five runs; model=small 917 against 1,068, three pairs),
    the same losses."""
    msrun = [sys.executable, "-c", "import sys; from mindspore.parallel.cluster.run import main; sys.exit(main())"]
    cluster = [f"--master_port={free_port()}"] if nodes.count == 1 else [
        f"--master_addr={nodes.master_addr}", f"--master_port={nodes.master_port}", f"--node_rank={nodes.rank}"]
    return [*msrun, f"--worker_num={workers}", f"--local_worker_num={workers // nodes.count}", *cluster,
            "--bind_core=True", "--join=True", f"--log_dir={nodes.log_dir(run_dir)}", script, *overrides,
            f"hydra.run.dir={run_dir}"]


def interpreter_env(log_dir: str) -> Dict[str, str]:
    """The environment for msrun: its workers start as `python SCRIPT` looked up on PATH, so PATH starts with a
    directory whose `python` runs this interpreter. (A venv's python given by its path, with PATH not holding
    the venv, would otherwise start the system's python: `No module named 'mindspore'` in every worker.) A
    wrapper script, not a symlink: a venv is recognised by the path the interpreter is started from."""
    shim = os.path.join(log_dir, "bin")
    os.makedirs(shim, exist_ok=True)
    python = os.path.join(shim, "python")
    with open(f"{python}.tmp", "w", encoding="utf-8") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    os.chmod(f"{python}.tmp", 0o755)
    os.replace(f"{python}.tmp", python)
    return {**os.environ, "PATH": os.pathsep.join([shim, os.environ.get("PATH", "")])}


def _done_marker(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "workers", f"done_{rank}")


def mark_done(run_dir: str, rank: int) -> None:
    """Called by a worker that finished normally: its exit is not a failure."""
    os.makedirs(os.path.dirname(_done_marker(run_dir, rank)), exist_ok=True)
    open(_done_marker(run_dir, rank), "w").close()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _worker_rank(proc: psutil.Process) -> Optional[int]:
    try:
        env = proc.environ()
    except psutil.Error:  # exited meanwhile
        return None
    return int(env["MS_NODE_ID"]) if env.get("MS_ROLE") == "MS_WORKER" and "MS_NODE_ID" in env else None


def _starting(proc: psutil.Process, msrun: subprocess.Popen) -> bool:
    """A process msrun started whose environment has no MS_ROLE yet (between fork and exec): it may still become
    a worker, so it must not be filed as something else."""
    try:
        return proc.ppid() == msrun.pid and "MS_ROLE" not in proc.environ()
    except psutil.Error:  # exited meanwhile
        return False


def _kill_tree(msrun: subprocess.Popen, known: List[psutil.Process]) -> None:
    """SIGKILL msrun and everything it started: workers (own sessions), scheduler, log tails."""
    try:
        known = known + psutil.Process(msrun.pid).children(recursive=True)
    except psutil.Error:
        pass
    for proc in [psutil.Process(msrun.pid), *known]:
        try:
            proc.kill()
        except psutil.Error:
            pass
    msrun.wait()


def _dead_unfinished(workers: Dict[int, psutil.Process], run_dir: str) -> List[int]:
    return [rank for rank, proc in sorted(workers.items())
            if not _alive(proc) and not os.path.exists(_done_marker(run_dir, rank))]


@dataclass
class Stopped:
    """Why `_watch` ended this node's job early: the ranks that died without finishing, or the other node that is gone
    (`node`, its one-line reason). Neither: msrun ended by itself."""
    ranks: List[int] = field(default_factory=list)
    node: Optional[str] = None


def _watch(msrun: subprocess.Popen, run_dir: str, peers: Optional[Peers] = None) -> Stopped:
    """Wait for msrun; kills this node's job when one of its ranks dies without finishing or another node is gone."""
    workers: Dict[int, psutil.Process] = {}
    seen: List[psutil.Process] = []
    polls = 0
    while msrun.poll() is None:
        polls += 1
        if peers is not None and polls % 10 == 1:
            peers.touch()
            other = peers.gone()
            if other is not None:
                _kill_tree(msrun, seen)
                return Stopped(node=other)
        try:  # new processes are looked for once a second; the known workers every poll
            children = psutil.Process(msrun.pid).children(recursive=True) if polls % 10 == 1 else []
        except psutil.Error:
            children = []
        for child in children:
            if child not in seen:
                rank = _worker_rank(child)
                if rank is None and _starting(child, msrun):  # forked, environment not set yet: look again
                    continue
                seen.append(child)
                if rank is not None and child.ppid() == msrun.pid:  # not a worker's own subprocess
                    workers[rank] = child
        if _dead_unfinished(workers, run_dir):
            # A SIGKILLed multi-GB process takes a while to become a zombie, and a peer aborted by the broken
            # collective can get there first (CI saw it): every rank that died within the grace time is named.
            time.sleep(GRACE_SECONDS)
            failed = _dead_unfinished(workers, run_dir)
            _kill_tree(msrun, seen)
            return Stopped(ranks=failed)
        time.sleep(POLL_SECONDS)
    return Stopped()


def _echo_console(stream) -> None:
    """msrun's stdout (its lines and the worker logs it tails) to this console, less the `[INFO]` lines of
    MindSpore's C++ log."""
    for line in stream:
        if not line.startswith("[INFO]"):
            sys.stdout.write(line)
            sys.stdout.flush()


def relaunch(workers: int, run_dir: str, nodes: int = 1, node_rank: int = 0, master_addr: Optional[str] = None,
             master_port: Optional[int] = None) -> int:
    """Run this script's command under msrun, this node's share of `workers` processes on it (all of them on one
    node); returns the exit code."""
    here = Nodes(nodes, node_rank, master_addr, master_port)
    overrides = [a for a in sys.argv[1:] if not a.startswith("hydra.run.dir=")]
    cmd = msrun_command(workers, run_dir, os.path.abspath(sys.argv[0]), overrides, here)
    print(f"[launch] {workers} workers: {' '.join(cmd)}", flush=True)
    for rank in here.ranks(workers):  # markers of an earlier launch into this run dir
        if os.path.exists(_done_marker(run_dir, rank)):
            os.remove(_done_marker(run_dir, rank))
    log_dir = here.log_dir(run_dir)
    os.makedirs(log_dir, exist_ok=True)
    peers = Peers(here, run_dir, workers) if nodes > 1 else None
    other = peers.gone() if peers is not None else None
    if other is not None:  # e.g. failed before launching: no workers to start
        print(f"[launch] {other}; started no workers on this node", file=sys.stderr)
        return 1
    with open(os.path.join(log_dir, "msrun.log"), "w", encoding="utf-8") as msrun_log:
        msrun = subprocess.Popen(cmd, env=interpreter_env(log_dir), stdout=subprocess.PIPE, stderr=msrun_log,
                                 text=True, errors="replace")
        echo = threading.Thread(target=_echo_console, args=(msrun.stdout,), daemon=True)
        echo.start()
        stopped = _watch(msrun, run_dir, peers)
        echo.join(timeout=2)  # a log tail msrun left behind may hold the pipe open
    if stopped.node is not None:
        print(f"[launch] {stopped.node}; stopped this node's workers", file=sys.stderr)
        return 1
    failed = stopped.ranks
    if not failed and msrun.returncode != 0:  # msrun ended the job before the watcher saw the worker die
        failed = [rank for rank in here.ranks(workers) if not os.path.exists(_done_marker(run_dir, rank))
                  and os.path.exists(os.path.join(log_dir, f"worker_{rank}.log"))]
    if not failed and msrun.returncode != 0:  # msrun itself failed, e.g. its scheduler could not bind
        failed_msrun = f"msrun exited {msrun.returncode} before its workers ran; see {msrun_log.name}"
        if peers is not None:
            peers.fail(failed_msrun)
        print(f"[launch] {failed_msrun}", file=sys.stderr)
        return 1
    if not failed:
        return msrun.returncode
    other = peers.gone() if peers is not None else None
    if other is not None:  # this node's workers died of another node's failure (a collective broke): name the cause
        print(f"[launch] {other}; stopped this node's workers", file=sys.stderr)
        return 1
    print(f"[launch] worker {', '.join(map(str, failed))} stopped without finishing; stopped the other workers",
          file=sys.stderr)
    if peers is not None:
        peers.fail(f"worker {', '.join(map(str, failed))} stopped without finishing; see {log_dir}")
    for rank in failed:
        log = os.path.join(log_dir, f"worker_{rank}.log")
        with open(log, errors="replace") as f:
            tail = [line for line in f.read().splitlines()
                    if not line.startswith(("[INFO]", "[WARNING]")) and "WARNING" not in line][-15:]
        if not any("error" in line.lower() or "Traceback" in line for line in tail):
            tail.append("(no error message: the process was killed, e.g. by a signal or the out-of-memory killer)")
        print(f"[launch] last lines of {log}:\n" + "\n".join(tail), file=sys.stderr)
    return 1


def loopback(addr: str) -> bool:
    """Whether `addr` (an address or a host name) is this machine's loopback, which no other node reaches."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name
        pass
    try:
        return any(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(addr, None))
    except (OSError, ValueError):  # not resolvable here: msrun says so
        return False


def _this_node(argv: Sequence[str]) -> Optional[Nodes]:
    """This launch's node of a multi-node run as its command line gives it (`nodes=`, `node_rank=`), or None (also
    for a dry run, which launches nothing)."""
    keys = {}
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        keys[key] = value
    if keys.get("dry_run", "false").lower() == "true":
        return None
    try:
        count, rank = int(keys.get("nodes", "1")), int(keys.get("node_rank", "0"))
    except ValueError:  # a bad value: no node to name (validation says what is wrong)
        return None
    return Nodes(count, rank) if count > 1 and 0 <= rank < count else None


@contextlib.contextmanager
def told_to_other_nodes(argv: Sequence[str]) -> Iterator[None]:
    """A multi-node launch that fails before its workers run (a bad override, a refused config, an msrun that cannot
    start) writes its one-line reason to workers/node<r>/failed, as a failed worker's launch does, so that the other
    nodes stop at once instead of waiting for its scheduler or workers until msrun's cluster timeout. Read from the
    command line, not the config: a bad override leaves no config; a worker (MS_ROLE set) is its launch's to report."""
    try:
        yield
    except Exception as err:
        node = _this_node(argv)
        run_dir = next((a.partition("=")[2] for a in argv if a.startswith("hydra.run.dir=")), None)
        if node is not None and run_dir and "MS_ROLE" not in os.environ:
            said = error_line(err)
            reason = said[0] if said is not None else f"{type(err).__name__}: {err} (its console has the traceback)"
            write_failed(node, run_dir, f"before launching: {reason}")
        raise
