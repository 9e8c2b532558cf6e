"""Run by tests/test_semi_auto.py under msrun: the tp/pp training path of trainer/loop.py on CPU, called
directly (train.py's validation refuses tp/pp on CPU), to show how far it gets here.

    semi_auto_probe.py RUN_DIR LAYOUT [LAYOUT ...]     (a LAYOUT: its overrides in one argument, space-separated)

Each layout in turn, in this one process (one msrun launch serves them all: a launch's imports and communication
init are most of its cost), its run dir RUN_DIR/<i>. For layout i it prints one line `probe <i>: <outcome>`, which
is MindSpore's parallel compiler stopping the first step here; then, from the model as the trainer sharded it,
`probe-model <i>: {json}`: the modules its cells come from, whether every strategy of the family's plan is set on
its primitive (inputs and, under sequence parallelism, outputs), and the pipeline stage of each part (null: none
set). The parallel context a stopped compile leaves is reset before the next layout (a layout whose dataset strategy
is not set still stops earlier, at "Invalid communication backend", when it runs second). The work runs under
`__main__` only: the data workers re-import this script."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the repo, as pytest.ini does, and conftest's helpers
from conftest import compose_cfg  # noqa: E402

import mindspore as ms  # noqa: E402

import distributed.semi_auto as semi_auto  # noqa: E402
from models import plan_of  # noqa: E402
from trainer.loop import train  # noqa: E402

sharded = {}
shard_model = semi_auto.shard_model


def recording(model, config):
    """The trainer's shard_model, keeping the model it laid out (trainer/module.py ShardedModule calls it)."""
    shard_model(model, config)
    sharded["model"] = model


def probe(i: int, run_dir: str, layout: list) -> None:
    """Layout i's two lines."""
    cfg = compose_cfg("model=tiny", "model.num_layers=2", "data.seq_len=64", "trainer.micro_batch_size=2",
                      "trainer.max_steps=1", "trainer.eval_batches=1", "logger.progress_bar=false",
                      "trainer.eval_at_start=false", *layout)  # the step's graph compiles first; pp=2: a layer a stage
    sharded.clear()
    try:
        train(cfg, run_dir)
        print(f"probe {i}: the sharded step ran", flush=True)
    except RuntimeError as err:
        print(f"probe {i}: {str(err).splitlines()[0]}", flush=True)
    finally:
        ms.reset_auto_parallel_context()  # what the compile that stopped set stays set: the next layout sets its own
    model, p = sharded["model"], cfg.parallel
    cells = dict(model.cells_and_names())
    plan = plan_of(cfg.model.family).tensor_parallel_strategies(model, p.dp, p.tp, p.sequence_parallel)
    outputs = plan_of(cfg.model.family).output_strategies(model, p.dp, p.tp, p.sequence_parallel)
    primitive = lambda path: getattr(cells[path.rpartition(".")[0]], path.rpartition(".")[2])
    applied = [path for path, strategy in plan.items() if primitive(path).in_strategy == strategy and
               getattr(primitive(path), "out_strategy", None) == outputs.get(path)]
    parts = plan_of(cfg.model.family).pipeline_parts(model)
    stages = {path: getattr(cells[path], "pipeline_stage", None) for path in parts}
    print(f"probe-model {i}: " + json.dumps({"modules": sorted({type(c).__module__ for c in cells.values()}),
                                            "strategies": len(plan), "applied": len(applied), "stages": stages}),
          flush=True)


def main() -> None:
    semi_auto.shard_model = recording
    for i, layout in enumerate(sys.argv[2:]):
        probe(i, os.path.join(sys.argv[1], str(i)), layout.split())
        # a process's device is set once: init() gave it this rank's id, which the trainer's set_device("CPU")
        # (id 0) would try to change; the next layouts run on the device as it is
        ms.set_device = lambda *args, **kwargs: None


if __name__ == "__main__":
    main()
