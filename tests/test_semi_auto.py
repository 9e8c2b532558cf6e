"""The tp/pp training path (distributed/semi_auto.py) as far as CPU can take it under msrun.

MindSpore compiles sharded and pipelined graphs only for Ascend/GPU. Here two msrun workers run the real
trainer path (scripts/semi_auto_probe.py; one launch, the layouts in turn) — communication init, shard() strategies
(with recompute and sequence parallelism's output strategies), pipeline stages, the sharded evaluation graph and
the PipelinedLoss / PipelineGradients step under AutoParallel with its dataset strategy, optimizer sharding — and
the first compile must stop inside MindSpore's parallel compiler with its CPU-backend error (BACKEND_ERROR says where).

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
BACKEND_ERROR = "Invalid backend: CPU"
LAYOUTS = {"tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.recompute=full"],
           "pp2": ["parallel.pp=2", "parallel.micro_batches=2"],
           "dp2-zero": ["parallel.dp=2", "parallel.optimizer_shard=true"]}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One msrun launch of two workers probing every layout in turn (scripts/semi_auto_probe.py): each worker's
    log, and msrun's exit code."""
    tmp = tmp_path_factory.mktemp("semi_auto")
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    logs = tmp / "workers"
    proc = subprocess.run([msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}", "--join=True",
                           f"--log_dir={logs}", os.path.join(ROOT, "scripts", "semi_auto_probe.py"), str(tmp),
                           *(" ".join(layout) for layout in LAYOUTS.values())], cwd=str(tmp), capture_output=True,
                          text=True, timeout=600)
    return [(logs / f"worker_{rank}.log").read_text(errors="replace") for rank in (0, 1)], proc.returncode


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.slow
def test_sharded_step_reaches_the_parallel_compiler(probed, layout):
    logs, returncode = probed
    i = list(LAYOUTS).index(layout)
    for log in logs:
        outcome = [line for line in log.splitlines() if line.startswith(f"probe {i}: ")]
        assert outcome == [f"probe {i}: {BACKEND_ERROR}"], (outcome, log[-3000:])
        (model,) = [json.loads(line.split(": ", 1)[1]) for line in log.splitlines()
                    if line.startswith(f"probe-model {i}: ")]
        ours = [m for m in model["modules"] if not m.startswith("mindspore.")]  # (CellList, recompute's wrappers)
        # plain cells: the family's and the shared blocks', no kernels/ or device twin
        assert ours == ["models.common.attention", "models.common.layers", "models.llama.model"]
        assert model["applied"] == model["strategies"] > 0
        pipelined = layout == "pp2"
        assert sorted(set(model["stages"].values()), key=str) == ([0, 1] if pipelined else [None])
    assert returncode == 0
