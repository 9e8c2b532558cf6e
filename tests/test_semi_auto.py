"""The tp/pp training path (distributed/semi_auto.py) as far as CPU can take it under msrun.

MindSpore compiles sharded and pipelined graphs only for Ascend/GPU. Here two msrun workers run the real
trainer path (scripts/semi_auto_probe.py) — communication init, shard() strategies (with recompute and sequence
parallelism's output strategies), pipeline stages, the sharded evaluation graph and the PipelinedLoss /
PipelineGradients step under AutoParallel with its dataset strategy, optimizer sharding — and the first compile
must stop inside MindSpore's parallel compiler with its CPU-backend error (BACKEND_ERROR says where).

What this proves: every stage before the compiler accepted the layout (no other error came first), and the model as
the trainer laid it out: its cells are model.py's plain ones (no CPU kernel or device twin), every strategy of the
family's plan is set on its primitive, the stages are set. The step's own pieces compile and compute right in
stand-alone graph mode (tests/test_sharded_step.py: the pipeline wrapper over tuple losses, the reducer, the
micro-batch mean, the clipping marks, the per-rank save). What neither can: that the parallel passes make a right
graph of them. A wrong strategy, a missing redistribution or a pipeline that deadlocks fails in the compiler or at
run time, after the point CPU stops at; only a run on Ascend/GPU (make device-check, its dp2xtp2xpp2 step) tells.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from distributed.launch import free_port

# MindSpore's refusal on CPU, from inside the parallel pass: with every graph input given a dataset strategy the
# step's graph is parsed, the pipeline cut into micro-batches and the loss cell's forward laid out before an operator
# finds no CPU backend for a sharded graph (without one, MindSpore refused earlier: "Invalid communication backend")
BACKEND_ERROR = "probe: Invalid backend: CPU"


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sequence_parallel=true", "model.recompute=full"],
                                    ["parallel.pp=2", "parallel.micro_batches=2"],
                                    ["parallel.dp=2", "parallel.optimizer_shard=true"]], ids=["tp2-sp", "pp2", "dp2-zero"])
@pytest.mark.slow
def test_sharded_step_reaches_the_parallel_compiler(tmp_path, layout):
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    logs = tmp_path / "workers"
    proc = subprocess.run([msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}", "--join=True",
                           f"--log_dir={logs}", os.path.join(ROOT, "scripts", "semi_auto_probe.py"), str(tmp_path),
                           *layout], cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    for rank in (0, 1):
        log = (logs / f"worker_{rank}.log").read_text(errors="replace")
        outcome = [line for line in log.splitlines() if line.startswith("probe: ")]
        assert outcome == [BACKEND_ERROR], (outcome, log[-3000:])
        (model,) = [json.loads(line.split(": ", 1)[1]) for line in log.splitlines() if line.startswith("probe-model: ")]
        ours = [m for m in model["modules"] if not m.startswith("mindspore.")]  # (CellList, recompute's wrappers)
        # plain cells: the family's and the shared blocks', no kernels/ or device twin
        assert ours == ["models.common.attention", "models.common.layers", "models.llama.model"]
        assert model["applied"] == model["strategies"] > 0
        pipelined = "parallel.pp=2" in layout
        assert sorted(set(model["stages"].values()), key=str) == ([0, 1] if pipelined else [None])
    assert proc.returncode == 0
