"""The layout search of `parallel=auto dry_run=true`: every layout of the devices that the config rules allow,
whether it fits (planner/memory.py, with headroom) and how fast it runs (planner/timing.py), fastest first.

A layout is dp x tp x pp (Megatron's rank order, planner/layout.py), optimizer sharding, recompute, the micro-batch
size and the micro-batches per step: the pipeline's (pp > 1) or gradient accumulation (pp = 1, plain data
parallelism only: the sharded step is one graph, base/validate.py). Every layout feeds the same global batch, so
their step times compare. The searched space:
  * tp: powers of two up to device.devices_per_node (a tensor-parallel group inside one node); pp: divisors of the
    layers; dp: the rest of the devices. Each (dp, tp, pp, optimizer sharding) is put through base/validate.py as
    the run would be (tp dividing the heads, a family without a tensor plan, an objective that refuses dp...).
  * sequence parallelism whenever tp > 1: the same bytes on the wire as the all-reduces it replaces (timing.py)
    and less activation memory, so a layout without it is never better.
  * micro-batch sizes 1, 2, 4 ... 32 that divide a replica's share of the batch; recompute none, selective, full.
"""
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from base.errors import ConfigError
from base.registry import FAMILIES, OBJECTIVES
from planner.memory import RECOMPUTE_MODES, MemoryPlan, ObjectiveMemory, fits, memory_plan, needed_bytes
from planner.timing import StepTime, step_time

# The global batch when trainer.global_batch_size is unset: Llama 2's 4M tokens (Touvron et al. 2023, section 2.2).
DEFAULT_BATCH_TOKENS = 4 * 2 ** 20
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
MAX_DEVICES = 4096  # how far "needs at least" looks


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    optimizer_shard: bool
    sequence_parallel: bool
    recompute: str
    micro_batch_size: int
    micro_batches: int  # per step and replica: the pipeline's (pp > 1) or gradient accumulation (pp = 1)
    ep: int = 1  # a mixture of experts' experts split over ep of the dp ranks

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        return f"dp{self.dp}tp{self.tp}pp{self.pp}" + (f"ep{self.ep}" if self.ep > 1 else "")

    def describe(self) -> str:
        flags = (" sp" if self.sequence_parallel else "") + (" zero1" if self.optimizer_shard else "")
        return f"dp{self.dp} tp{self.tp} pp{self.pp}{f' ep{self.ep}' if self.ep > 1 else ''}{flags}"

    def overrides(self) -> List[str]:
        """The command-line overrides that run this layout: parallel=single's keys replaced (defaults left out)."""
        keys = ["parallel=single", f"parallel.name={self.name}", f"parallel.dp={self.dp}", f"parallel.tp={self.tp}",
                f"parallel.pp={self.pp}"]
        keys += [f"parallel.ep={self.ep}"] if self.ep > 1 else []
        keys += [f"parallel.micro_batches={self.micro_batches}"] if self.pp > 1 else []
        keys += ["parallel.sequence_parallel=true"] if self.sequence_parallel else []
        keys += ["parallel.optimizer_shard=true"] if self.optimizer_shard else []
        keys += [f"trainer.micro_batch_size={self.micro_batch_size}"]
        keys += [f"trainer.grad_accum={self.micro_batches}"] if self.pp == 1 and self.micro_batches > 1 else []
        return keys + [f"model.recompute={self.recompute}"]


@dataclass(frozen=True)
class Option:
    """A candidate with its memory plan (the fullest stage) and its step time."""
    candidate: Candidate
    plan: MemoryPlan
    time: StepTime
    fits: bool


def global_batch(cfg: Any) -> int:
    """Sequences per step the search feeds every layout: trainer.global_batch_size, else DEFAULT_BATCH_TOKENS."""
    return cfg.trainer.global_batch_size or max(1, DEFAULT_BATCH_TOKENS // cfg.data.seq_len)


def candidate_of(cfg: Any) -> Candidate:
    """The layout a composed config runs."""
    p, t = cfg.parallel, cfg.trainer
    return Candidate(p.dp, p.tp, p.pp, bool(p.optimizer_shard), bool(p.sequence_parallel), cfg.model.recompute,
                     t.micro_batch_size, p.micro_batches if p.pp > 1 else t.grad_accum, p.ep)


class Search:
    """Layouts for one composed config (its model, objective, device, precision and sequence length)."""

    def __init__(self, cfg: Any):
        self.cfg, self.m, self.device = cfg, cfg.model, cfg.device
        self.dtype, self.seq_len = cfg.precision.compute_dtype, cfg.data.seq_len

    def refusal(self, dp: int, tp: int, pp: int, optimizer_shard: bool) -> Optional[str]:
        """Why base/validate.py refuses this grid point (None: allowed). The rules see dp only as dp > 1 (optimizer
        sharding needs it, an objective may refuse it), so one check stands for every dp."""
        return self._refusal(min(dp, 2), tp, pp, optimizer_shard)

    @functools.lru_cache(maxsize=None)
    def _refusal(self, dp: int, tp: int, pp: int, optimizer_shard: bool) -> Optional[str]:
        from base.validate import validate  # base/ is below the planner: a function-level import of validation

        layout = {"name": f"dp{dp}tp{tp}pp{pp}", "dp": dp, "tp": tp, "pp": pp, "micro_batches": pp,
                  "sequence_parallel": tp > 1, "optimizer_shard": optimizer_shard}
        trial = OmegaConf.merge(self.cfg, {"parallel": layout, "nodes": None, "dry_run": True,
                                           "trainer": {"grad_accum": 1, "global_batch_size": None}})
        try:
            validate(trial)
        except ConfigError as err:
            return str(err)
        return None

    @functools.lru_cache(maxsize=None)
    def _needs(self, micro_batch_size: int) -> ObjectiveMemory:
        plugin = OBJECTIVES[self.cfg.objective.name]
        if plugin.memory is None:
            return ObjectiveMemory()
        return plugin.memory(OmegaConf.merge(self.cfg, {"trainer": {"micro_batch_size": micro_batch_size}}))

    @functools.lru_cache(maxsize=None)
    def _flash(self, sharded: bool) -> bool:
        """Whether the attention keeps no [S, S] probabilities (flash, or a family's fused CPU kernel)."""
        return FAMILIES[self.m.family].attention_kind(self.m, self.device.target, self.dtype, sharded) != "plain"

    def option(self, c: Candidate) -> Option:
        needs = self._needs(c.micro_batch_size)
        plan = memory_plan(self.m, c, self.seq_len, c.micro_batch_size, self.dtype, c.recompute,
                           self._flash(c.tp * c.pp > 1), needs)
        time = step_time(self.m, c, self.device, self.seq_len, c.micro_batch_size, c.micro_batches, self.dtype,
                         c.recompute, needs.sequences)
        return Option(c, plan, time, fits(plan, self.device))

    def grid(self, devices: int) -> List[Tuple[int, int, int, bool]]:
        """(dp, tp, pp, optimizer_shard) of `devices` that validation allows."""
        points = []
        tp = 1
        while tp <= min(devices, self.device.devices_per_node):
            for pp in (d for d in range(1, self.m.num_layers + 1) if self.m.num_layers % d == 0):
                if devices % (tp * pp):
                    continue
                dp = devices // (tp * pp)
                for shard in ((False, True) if dp > 1 else (False,)):
                    if self.refusal(dp, tp, pp, shard) is None:
                        points.append((dp, tp, pp, shard))
            tp *= 2
        return points

    def expert_splits(self, dp: int) -> List[int]:
        """The ep a layout of `dp` replicas may take: 1, and for a mixture of experts every ep dividing both dp and
        the experts (base/validate.py's rule)."""
        experts = FAMILIES[self.m.family].experts
        if experts is None:
            return [1]
        n = experts(self.m)[0]
        return [ep for ep in range(1, dp + 1) if dp % ep == 0 and n % ep == 0]

    def candidates(self, devices: int, batch: int, lightest: bool = False) -> List[Candidate]:
        """The layouts of `devices` feeding `batch` sequences per step; `lightest`: per grid point only the one
        needing the least memory (full recompute, the smallest micro-batch it allows)."""
        out = []
        for dp, tp, pp, shard in self.grid(devices):
            if batch % dp:
                continue
            per_replica = batch // dp
            for size in MICRO_BATCH_SIZES:
                if per_replica % size:
                    continue
                micro_batches = per_replica // size
                if pp > 1 and micro_batches < pp:
                    continue
                if pp == 1 and micro_batches > 1 and (tp > 1 or shard):  # one sharded graph: no accumulation
                    continue
                modes = ("full",) if lightest else RECOMPUTE_MODES
                out += [Candidate(dp, tp, pp, shard, tp > 1, mode, size, micro_batches, ep) for mode in modes
                        for ep in self.expert_splits(dp)]
                if lightest:
                    break
        return out

    def options(self, devices: int, batch: int) -> List[Option]:
        """Every candidate of `devices`, fitting or not, fastest first."""
        return sorted((self.option(c) for c in self.candidates(devices, batch)),
                      key=lambda o: (o.time.step, needed_bytes(o.plan)))

    def ranked(self, devices: int, batch: int) -> List[Option]:
        """The candidates that fit, fastest first, less the beaten ones (best_of)."""
        return best_of(self.options(devices, batch))

    def nearest(self, current: Candidate, batch: int, count: int = 3) -> List[Option]:
        """Layouts of the same devices that fit, fewest changes to `current` first, then fastest."""
        def changes(c: Candidate) -> int:
            keys = ("dp", "tp", "pp", "optimizer_shard", "recompute", "micro_batch_size", "micro_batches")
            return sum(getattr(c, k) != getattr(current, k) for k in keys)

        fitting = self.ranked(current.world, batch)
        return sorted(fitting, key=lambda o: (changes(o.candidate), o.time.step))[:count]

    def devices_needed(self, devices: int, batch: int) -> Optional[int]:
        """The fewest devices, in whole nodes beyond `devices`, on which some layout fits (None: not even
        MAX_DEVICES); memory alone decides, so each grid point's lightest layout is enough."""
        per_node = self.device.devices_per_node

        for count in range((devices // per_node + 1) * per_node, MAX_DEVICES + 1, per_node):
            for c in self.candidates(count, batch, lightest=True):
                plan = memory_plan(self.m, c, self.seq_len, c.micro_batch_size, self.dtype, c.recompute,
                                   self._flash(c.tp * c.pp > 1), self._needs(c.micro_batch_size))
                if fits(plan, self.device):
                    return count
        return None


def best_of(options: List[Option]) -> List[Option]:
    """The options that fit, in their order, less those a sibling beats: the same dp, tp, pp and micro-batches, no
    slower with no more memory (selective recompute where flash attention keeps no probabilities anyway; optimizer
    sharding never does, it costs no time here)."""
    fitting = [o for o in options if o.fits]

    def key(o: Option) -> tuple:
        c = o.candidate
        return c.dp, c.tp, c.pp, c.micro_batch_size, c.micro_batches

    def beaten(o: Option) -> bool:
        return any(key(x) == key(o) and x.time.step <= o.time.step and x.plan.total <= o.plan.total
                   and (x.time.step, x.plan.total) != (o.time.step, o.plan.total) for x in fitting)

    return [o for o in fitting if not beaten(o)]


def summary_row(rank: int, o: Option, usable: float) -> Dict[str, str]:
    """One line of the ranked table."""
    c, t = o.candidate, o.time
    by_kind = {kind: sum(x.exposed for x in t.comms if x.kind == kind) for kind in ("tp", "dp", "pp")}
    return {
        "#": str(rank), "layout": c.describe(), "mbs": str(c.micro_batch_size),
        "micro-batches": f"{c.micro_batches}" + (" (accum)" if c.pp == 1 and c.micro_batches > 1 else ""),
        "recompute": c.recompute, "memory GiB": f"{needed_bytes(o.plan) / 2 ** 30:.1f} ({needed_bytes(o.plan) / usable:.0%})",
        "bubble": f"{t.bubble_fraction:.0%}", "comm s tp/dp/pp": "/".join(f"{by_kind[k]:.2f}" for k in ("tp", "dp", "pp")),
        "step s": f"{t.step:.3g}", "tokens/s/device": f"{t.tokens_per_s_per_device:,.0f}", "MFU": f"{t.mfu:.0%}",
    }


def format_table(rows: List[Dict[str, str]]) -> str:
    if not rows:
        return ""
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    lines = ["  ".join(k.ljust(widths[k]) for k in rows[0])]
    lines += ["  ".join(r[k].ljust(widths[k]) for k in r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
