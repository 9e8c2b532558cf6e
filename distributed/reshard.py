"""Move a checkpoint between layouts: full <-> per-rank slices, and one sharded layout to another.

    python -m distributed.reshard split  runs/a/checkpoints/step_000400 out/tp8pp2 --tp 8 --pp 2
    python -m distributed.reshard merge  out/tp8pp2 out/full          # a plain mindlab checkpoint again
    python -m distributed.reshard reshard out/tp8pp2 out/tp4pp4 --tp 4 --pp 4
    python -m distributed.reshard split  runs/a/checkpoints/step_000400 out/tp8dp4 --tp 8 --dp 4 --optimizer-shard
    python -m distributed.reshard split  runs/moe/checkpoints/step_000400 out/ep4tp2 --dp 4 --ep 4 --tp 2

A sharded directory is described in distributed/sharded_checkpoint.py (rank_<r>/ slices + MindSpore strategy
files); merge and reshard run MindSpore's `transform_checkpoints` on it, so they also take the slices and
strategy file of a sharded Ascend run. `--ep` (a mixture of experts) splits the routed experts over ep of the dp
ranks, tp within each expert, as the family's plan lays them out (models/moe/plan.py: each group of ep consecutive
dp ranks holds all the experts). state.json, config.yaml and tokenizer.model travel along, so a merged
checkpoint resumes, converts (models.convert) and initialises runs (stage.init_from) like any other. The output goes to
a new directory, or replaces a previous output of this command whole (base/outputs.py): never into a directory of
other files.
"""
import json
import os
import shutil
import sys
from argparse import RawDescriptionHelpFormatter
from typing import Dict

import numpy as np

import boot  # noqa: F401  (mindspore first)
from distributed.sharded_checkpoint import OPTIMIZER_STATE, layout_for, load_tensors, merge_checkpoint, \
    reshard_checkpoint, save_tensors, split_checkpoint
from base.checkpoint import CONFIG, OPTIMIZER, STATE, TOKENIZER, WEIGHTS, CheckpointError, resolve, write_state
from base.errors import ArgumentParser, UsageError, entry_point, number
from base.outputs import output_dir
from models import family, plan_of

METADATA = (STATE, CONFIG, TOKENIZER)


def _copy_metadata(src: str, dst: str) -> None:
    for name in METADATA:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def family_name(directory: str) -> str:
    """The model family a checkpoint's config.yaml names (Llama when it names none)."""
    from omegaconf import OmegaConf

    config = os.path.join(directory, CONFIG)
    cfg = OmegaConf.load(config) if os.path.isfile(config) else OmegaConf.create()
    return OmegaConf.select(cfg, "model.family", default="llama")


def family_plan(directory: str, dp: int = 1, ep: int = 1, sharded_optimizer: bool = False):
    """The tensor/pipeline plan of the checkpoint's model family, for a target layout whose `ep` it takes: only a
    family with experts, ep dividing dp, without optimizer sharding (its strategy for expert slices is not written)."""
    name = family_name(directory)
    if ep > 1:
        if family(name).experts is None:
            raise UsageError(f"--ep: model.family={name} has no experts to split; leave --ep out")
        if dp % ep:
            raise UsageError(f"--ep: ep={ep} does not divide dp={dp} (the experts are split over ep of the dp "
                             f"ranks); choose --dp a multiple of --ep")
        if sharded_optimizer:
            raise UsageError("--ep: expert-parallel slices are not written with --optimizer-shard; drop one of them")
    return plan_of(name)


def split(src: str, out: str, dp: int, tp: int, pp: int, sharded_optimizer: bool = False, ep: int = 1) -> None:
    tensors: Dict[str, np.ndarray] = {}
    for name in (WEIGHTS, OPTIMIZER):
        if os.path.isfile(os.path.join(src, name)):
            tensors.update(load_tensors(os.path.join(src, name)))
    if not tensors:
        raise CheckpointError(f"{src}: no {WEIGHTS}; give a mindlab checkpoint directory (checkpoints/step_N)")
    plan = family_plan(src, dp, ep, sharded_optimizer)
    split_checkpoint(tensors, layout_for(tensors, dp, tp, pp, plan, ep), out, plan, sharded_optimizer)
    _copy_metadata(src, out)


def merge(src: str, out: str) -> None:
    tensors = merge_checkpoint(src)
    optimizer = {n: a for n, a in tensors.items() if OPTIMIZER_STATE.match(n) or n == "global_step"}
    save_tensors({n: a for n, a in tensors.items() if n not in optimizer}, os.path.join(out, WEIGHTS))
    if optimizer:
        save_tensors(optimizer, os.path.join(out, OPTIMIZER))
    _copy_metadata(src, out)
    state_file = os.path.join(out, STATE)
    if os.path.isfile(state_file):  # the merged files differ in bytes from the originals: record their sizes
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
        write_state(out, state)


@entry_point
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m distributed.reshard", description=__doc__,
                            formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["split", "merge", "reshard"])
    parser.add_argument("source", help="a mindlab checkpoint (split) or a sharded one (merge, reshard): a step "
                        "directory, or the run directory, its checkpoints/ or latest")
    parser.add_argument("out", help="output directory: a new one, or a previous output of this command")
    for axis in ("dp", "tp", "pp"):
        parser.add_argument(f"--{axis}", type=number(int, 1), default=1, help=f"{axis} of the target layout (split, reshard)")
    parser.add_argument("--ep", type=number(int, 1), default=1,
                        help="a mixture of experts' expert parallelism of the target layout: its experts over ep of "
                             "the dp ranks (split, reshard)")
    parser.add_argument("--optimizer-shard", action="store_true",
                        help="the target layout shards the optimizer (parallel.optimizer_shard=true; split, reshard)")
    args = parser.parse_args(argv)
    args.source = resolve(args.source)  # a run, its checkpoints/, `latest` or a step, as every checkpoint argument
    if not os.path.isdir(args.source):
        raise UsageError(f"{args.source}: no such directory; give a checkpoint directory (checkpoints/step_N)")
    with output_dir(args.out, "distributed.reshard") as tmp:  # a new directory, or a previous output, replaced whole
        if args.command == "split":
            split(args.source, str(tmp), args.dp, args.tp, args.pp, args.optimizer_shard, args.ep)
        elif args.command == "merge":
            merge(args.source, str(tmp))
        else:
            reshard_checkpoint(args.source, args.dp, args.tp, args.pp, str(tmp),
                               family_plan(args.source, args.dp, args.ep, args.optimizer_shard), args.optimizer_shard,
                               args.ep)
            _copy_metadata(args.source, str(tmp))
    print(f"[reshard] {args.command}: {args.source} -> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
