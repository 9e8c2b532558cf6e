"""The tp/pp training path (distributed/semi_auto.py) as far as CPU can take it.

MindSpore compiles sharded and pipelined graphs only for Ascend/GPU. Here two msrun workers run the real
trainer path — communication init, shard() strategies (with recompute), pipeline stages, the
Pipeline/PipelineGradReducer step under AutoParallel, optimizer sharding — and the first step must stop
exactly at MindSpore's parallel compiler with its CPU-backend error, i.e. everything before it was
accepted. The step itself is NOT executed here.
"""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from distributed.launch import free_port

BACKEND_ERROR = ("probe: Invalid communication backend: CPU for semi_auto_parallel/auto_parallel mode, currently only "
                 "support Ascend/GPU backend.")


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sequence_parallel=true", "model.recompute=full"],
                                    ["parallel.pp=2", "parallel.micro_batches=2"],
                                    ["parallel.dp=2", "parallel.optimizer_shard=true"]], ids=["tp2-sp", "pp2", "dp2-zero"])
@pytest.mark.slow
def test_sharded_step_reaches_the_parallel_compiler(tmp_path, layout):
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    logs = tmp_path / "workers"
    proc = subprocess.run([msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}", "--join=True",
                           f"--log_dir={logs}", os.path.join(ROOT, "tests", "semi_auto_probe.py"), str(tmp_path),
                           *layout], cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    for rank in (0, 1):
        log = (logs / f"worker_{rank}.log").read_text(errors="replace")
        outcome = [line for line in log.splitlines() if line.startswith("probe: ")]
        assert outcome == [BACKEND_ERROR], (outcome, log[-3000:])
    assert proc.returncode == 0
