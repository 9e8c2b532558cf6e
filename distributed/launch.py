"""Start a multi-process layout on this machine: `python train.py parallel=dp2` re-runs itself under msrun.

Every worker gets the same command line plus the parent's Hydra run dir, so all ranks share one run dir;
msrun writes one log per worker to <run dir>/workers/. The launch fails (non-zero) as soon as any worker
fails: msrun tears the others down. Multi-node: start msrun yourself on each node (see README).
"""
import os
import shutil
import socket
import subprocess
import sys
from typing import List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_command(workers: int, run_dir: str, script: str, overrides: List[str]) -> List[str]:
    msrun = shutil.which("msrun") or os.path.join(os.path.dirname(sys.executable), "msrun")
    return [msrun, f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port()}",
            "--join=True", f"--log_dir={os.path.join(run_dir, 'workers')}", script, *overrides,
            f"hydra.run.dir={run_dir}"]


def relaunch(workers: int, run_dir: str) -> int:
    """Run this script's command under msrun with `workers` local processes; returns the exit code."""
    overrides = [a for a in sys.argv[1:] if not a.startswith("hydra.run.dir=")]
    cmd = msrun_command(workers, run_dir, os.path.abspath(sys.argv[0]), overrides)
    print(f"[launch] {workers} workers: {' '.join(cmd)}", flush=True)
    code = subprocess.call(cmd)
    if code:
        for name in sorted(os.listdir(os.path.join(run_dir, "workers"))):
            with open(os.path.join(run_dir, "workers", name), errors="replace") as f:
                tail = [line for line in f.read().splitlines() if "WARNING" not in line][-15:]
            if any("Error" in line or "error" in line for line in tail):
                print(f"[launch] {name}:\n" + "\n".join(tail), file=sys.stderr)
    return code
