"""scripts/slurm_msrun.sbatch renders one msrun per node with the right ranks (Slurm itself is faked)."""
import os
import stat
import subprocess

from conftest import ROOT


def _fake(bin_dir, name, body):
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_each_node_gets_its_msrun_command(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "scontrol", 'printf "gpu-a\\ngpu-b\\n"')
    # srun runs its command once per node, as Slurm would with --ntasks-per-node=1 on 2 nodes
    _fake(bin_dir, "srun", 'shift; for n in 0 1; do SLURM_NODEID=$n "$@"; done')
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    _fake(scripts, "venv.sh", 'echo "$@"')  # print the command instead of running it
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(tmp_path)}
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_msrun.sbatch"), "model=13b",
                          "parallel=tp8pp2"], env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 2
    for node, line in enumerate(lines):
        assert line == (f"msrun --worker_num=16 --local_worker_num=8 --master_addr=gpu-a --master_port=8118 "
                        f"--node_rank={node} --join=True --log_dir=runs/slurm-42/workers/node{node} train.py "
                        f"hydra.run.dir=runs/slurm-42 model=13b parallel=tp8pp2")
