"""The tp/pp training path (distributed/semi_auto.py) as far as CPU can take it.

MindSpore compiles sharded and pipelined graphs only for Ascend/GPU. Here two msrun workers run the real
trainer path — communication init, shard() strategies (with recompute), pipeline stages, the
Pipeline/PipelineGradReducer step under AutoParallel, optimizer sharding — and the first step must stop
exactly at MindSpore's parallel compiler with its CPU-backend error.

What this can assert: every stage before the compiler accepted the layout (no other error came first), and the model
as the trainer laid it out: its cells are model.py's plain ones (no CPU kernel or device twin: the plan's strategies
are on the plain primitives), every strategy of the family's plan is set on its primitive, the stages are set.
What it cannot: that the compiled step is right. A wrong strategy, a missing redistribution or a pipeline that
deadlocks fails in the compiler or at run time, after the point CPU stops at; a correct build and a broken one stop
here with the same error. Only a run on Ascend/GPU (make device-check, its dp2xtp2xpp2 step) tells them apart.
"""
import json
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
        (model,) = [json.loads(line.split(": ", 1)[1]) for line in log.splitlines() if line.startswith("probe-model: ")]
        ours = [m for m in model["modules"] if not m.startswith("mindspore.")]  # (CellList, recompute's wrappers)
        assert ours == ["models.llama.model"]  # plain cells: no kernels/ or device twin
        assert model["applied"] == model["strategies"] > 0
        pipelined = "parallel.pp=2" in layout
        assert sorted(set(model["stages"].values()), key=str) == ([0, 1] if pipelined else [None])
    assert proc.returncode == 0
