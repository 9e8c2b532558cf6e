"""The layout search of `parallel=auto dry_run=true`: every layout of the devices that the config rules allow,
whether it fits (planner/memory.py, with headroom) and how fast it runs (planner/timing.py), fastest first.

A layout is dp x tp x cp x pp (Megatron's rank order, planner/layout.py), the cp algorithm, virtual pipeline
stages, optimizer sharding (ZeRO-1 or ZeRO-3), recompute, the micro-batch size and the micro-batches per step: the
pipeline's (pp > 1) or gradient accumulation (pp = 1, plain data parallelism only: the sharded step is one graph,
base/validate.py). Every layout feeds the same global batch, so their step times compare. The searched space:
  * tp: powers of two up to device.devices_per_node (a tensor-parallel group inside one node); cp: powers of two
    while each rank keeps MIN_CP_TOKENS of a sequence, with ring, ulysses and (where it differs from both) hybrid;
    pp: divisors of the layers, with vp 1, 2 or 4 virtual stages where pp x vp divides them; dp: the rest of the
    devices. Each grid point is put through base/validate.py as the run would be, with the device's own rules
    (tp dividing the heads, flash attention or cp without a kernel on the target, a family without a tensor
    plan, an objective that refuses dp...); what it refuses is counted by reason (Search.refused) for the report.
  * sequence parallelism whenever tp > 1: the same bytes on the wire as the all-reduces it replaces (timing.py)
    and less activation memory, so a layout without it is never better; tensor-parallel overlap the same,
    wherever validation allows it.
  * micro-batch sizes 1, 2, 4 ... 32 that divide a replica's share of the batch; recompute none, selective, full.
"""
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional

from omegaconf import OmegaConf

from base.errors import ConfigError
from base.registry import FAMILIES, OBJECTIVES
from base.schema import ulysses_degree
from planner.memory import RECOMPUTE_MODES, MemoryPlan, ObjectiveMemory, fits, memory_plan, needed_bytes
from planner.timing import StepTime, step_time

# The global batch when trainer.global_batch_size is unset: Llama 2's 4M tokens (Touvron et al. 2023, section 2.2).
DEFAULT_BATCH_TOKENS = 4 * 2 ** 20
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
MAX_DEVICES = 4096  # how far "needs at least" looks
COMM_KINDS = ("tp", "cp", "dp", "pp", "ep")  # the table's communication column: exposed seconds of each kind
VIRTUAL_STAGES = (2, 4)  # interleaved schedules searched besides the plain one
# cp is searched while each rank keeps at least this many tokens of a sequence: below it the ring's blocks are too
# small to hide their transfer (Megatron-LM's context parallelism targets 8k and longer sequences)
MIN_CP_TOKENS = 2048


class Point(NamedTuple):
    """A grid point of the search: everything but the batch split and recompute."""
    dp: int
    tp: int
    cp: int
    cp_algo: str
    pp: int
    vp: int
    optimizer_shard: bool
    zero3: bool
    tp_overlap: bool


class Plain(dict):
    """A config as plain dicts read by attribute: the search reads the model and device in its inner loop, where
    OmegaConf's attribute access costs more than the arithmetic."""
    __getattr__ = dict.__getitem__


def plain(node: Any) -> Plain:
    def convert(value: Any) -> Any:
        return Plain({k: convert(v) for k, v in value.items()}) if isinstance(value, dict) else value

    return convert(OmegaConf.to_container(node, resolve=True))


def _powers(limit: int) -> List[int]:
    """1, 2, 4 ... up to limit."""
    out = [1]
    while out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return out


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
    cp: int = 1
    cp_algo: str = "ring"
    vp: int = 1
    zero3: bool = False
    tp_overlap: bool = False
    ep: int = 1  # a mixture of experts' experts split over ep of the dp ranks

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def name(self) -> str:
        cp = f"cp{self.cp}" if self.cp > 1 else ""
        return f"dp{self.dp}tp{self.tp}{cp}pp{self.pp}" + (f"ep{self.ep}" if self.ep > 1 else "")

    def describe(self) -> str:
        cp = f" cp{self.cp} {self.cp_algo}" if self.cp > 1 else ""
        vp = f" vp{self.vp}" if self.vp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        flags = (" sp" if self.sequence_parallel else "") + (" tp-overlap" if self.tp_overlap else "") + (
            " zero3" if self.zero3 else " zero1" if self.optimizer_shard else "")
        return f"dp{self.dp} tp{self.tp}{cp} pp{self.pp}{vp}{ep}{flags}"

    def overrides(self) -> List[str]:
        """The command-line overrides that run this layout: parallel=single's keys replaced (defaults left out)."""
        keys = ["parallel=single", f"parallel.name={self.name}", f"parallel.dp={self.dp}", f"parallel.tp={self.tp}",
                f"parallel.pp={self.pp}"]
        keys += [f"parallel.cp={self.cp}", f"parallel.cp_algo={self.cp_algo}"] if self.cp > 1 else []
        keys += [f"parallel.vp={self.vp}"] if self.vp > 1 else []
        keys += [f"parallel.ep={self.ep}"] if self.ep > 1 else []
        keys += [f"parallel.micro_batches={self.micro_batches}"] if self.pp > 1 else []
        keys += ["parallel.sequence_parallel=true"] if self.sequence_parallel else []
        keys += ["parallel.tp_overlap=true"] if self.tp_overlap else []
        keys += ["parallel.optimizer_shard=true"] if self.optimizer_shard else []
        keys += ["parallel.zero3=true"] if self.zero3 else []
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
                     t.micro_batch_size, p.micro_batches if p.pp > 1 else t.grad_accum, p.cp, p.cp_algo, p.vp,
                     bool(p.zero3), bool(p.tp_overlap), p.ep)


class Search:
    """Layouts for one composed config (its model, objective, device, precision and sequence length)."""

    def __init__(self, cfg: Any):
        self.cfg, self.m, self.device = cfg, plain(cfg.model), plain(cfg.device)
        self.dtype, self.seq_len = cfg.precision.compute_dtype, cfg.data.seq_len
        self.refused: Dict[str, List] = {}  # the refusing key -> [its first message, grid points refused]
        # one copy of the config whose layout each grid point sets in turn (merging a config per point is slow),
        # its interpolations resolved once: none reads the layout, and resolving them on every read of every
        # grid point's validation was most of the search's time
        self._trial = OmegaConf.merge(cfg, {"nodes": None, "dry_run": True,
                                            "trainer": {"grad_accum": 1, "global_batch_size": None}})
        OmegaConf.resolve(self._trial)

    def refusal(self, point: "Point") -> Optional[ConfigError]:
        """Why base/validate.py refuses this grid point (None: allowed). The rules see dp only as dp > 1 (optimizer
        sharding needs it, an objective may refuse it), so one check stands for every dp."""
        return self._refusal(point._replace(dp=min(point.dp, 2)))

    @functools.lru_cache(maxsize=None)
    def _refusal(self, point: "Point") -> Optional[ConfigError]:
        from base.validate import validate_layout  # base/ is below the planner: a function-level import

        p = self._trial.parallel
        for key, value in point._asdict().items():
            setattr(p, key, value)
        p.name, p.micro_batches, p.sequence_parallel = "searched", point.pp, point.tp > 1
        try:
            validate_layout(self._trial)
        except ConfigError as err:
            return err
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
                           self._flash(c.tp * c.cp * c.pp > 1), needs)
        flash = self._flash(c.tp * c.cp * c.pp > 1)
        time = step_time(self.m, c, self.device, self.seq_len, c.micro_batch_size, c.micro_batches, self.dtype,
                         c.recompute, needs.sequences, plain_attention=not flash)
        return Option(c, plan, time, fits(plan, self.device))

    def grid(self, devices: int) -> List["Point"]:
        """The grid points of `devices` that validation allows; what it refused is kept in self.refused (by the key
        that refused: its first message and how many points) for the report's one line."""
        points, self.refused = [], {}
        per_node, layers = self.device.devices_per_node, self.m.num_layers
        for tp in _powers(min(devices, per_node)):
            for cp in _powers(devices // tp):
                if cp > 1 and self.seq_len // cp < MIN_CP_TOKENS:
                    break
                for pp in (d for d in range(1, layers + 1) if layers % d == 0 and devices % (tp * cp * d) == 0):
                    dp = devices // (tp * cp * pp)
                    for point in self._variants(dp, tp, cp, pp):
                        why = self.refusal(point)
                        if why is None:
                            points.append(point)
                        else:
                            self.refused.setdefault(why.key, [str(why), 0])[1] += 1
        return points

    def expert_splits(self, dp: int) -> List[int]:
        """The ep a layout of `dp` replicas may take: 1, and for a mixture of experts every ep dividing both dp and
        the experts (base/validate.py's rule)."""
        experts = FAMILIES[self.m.family].experts
        if experts is None:
            return [1]
        n = experts(self.m)[0]
        return [ep for ep in range(1, dp + 1) if dp % ep == 0 and n % ep == 0]

    def _variants(self, dp: int, tp: int, cp: int, pp: int) -> List["Point"]:
        """The options of one dp x tp x cp x pp: the cp algorithms, virtual stages, sharding levels; tensor-parallel
        overlap wherever validation allows it (it only hides time)."""
        u_inside = ulysses_degree(cp, "hybrid", tp, self.device.devices_per_node)
        algos = ["ring"] + (["ulysses"] if cp > 1 else []) + (["hybrid"] if 1 < u_inside < cp else [])
        vps = [1] + [v for v in VIRTUAL_STAGES if pp > 1 and self.m.num_layers % (pp * v) == 0]
        shards = [(False, False)] + ([(True, False), (True, True)] if dp * cp > 1 else [])
        out = []
        for algo in algos:
            for vp in vps:
                for shard, zero3 in shards:
                    point = Point(dp, tp, cp, algo, pp, vp, shard, zero3, tp > 1)
                    if point.tp_overlap and self.refusal(point) is not None:
                        point = point._replace(tp_overlap=False)
                    out.append(point)
        return out

    def candidates(self, devices: int, batch: int, lightest: bool = False) -> List[Candidate]:
        """The layouts of `devices` feeding `batch` sequences per step; `lightest`: per grid point only the one
        needing the least memory (full recompute, the smallest micro-batch it allows)."""
        out = []
        for point in self.grid(devices):
            dp, tp, pp, shard = point.dp, point.tp, point.pp, point.optimizer_shard
            if batch % dp:
                continue
            per_replica = batch // dp
            for size in MICRO_BATCH_SIZES:
                if per_replica % size:
                    continue
                micro_batches = per_replica // size
                if pp > 1 and (micro_batches < pp or point.vp > 1 and micro_batches % pp):
                    continue
                if pp == 1 and micro_batches > 1 and (tp > 1 or shard or point.cp > 1):  # one sharded graph
                    continue
                modes = ("full",) if lightest else RECOMPUTE_MODES
                out += [Candidate(dp, tp, pp, shard, tp > 1, mode, size, micro_batches, point.cp, point.cp_algo,
                                  point.vp, point.zero3, point.tp_overlap, ep) for mode in modes
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
            keys = ("dp", "tp", "cp", "cp_algo", "pp", "vp", "optimizer_shard", "zero3", "recompute",
                    "micro_batch_size", "micro_batches")
            return sum(getattr(c, k) != getattr(current, k) for k in keys)

        fitting = self.ranked(current.world, batch)
        return sorted(fitting, key=lambda o: (changes(o.candidate), o.time.step))[:count]

    def devices_needed(self, devices: int, batch: int) -> Optional[int]:
        """The fewest devices, in whole nodes beyond `devices`, on which some layout fits (None: not even
        MAX_DEVICES); memory alone decides, so each grid point's lightest layout is enough. Every node count is
        tried: a layout that fits on n devices may not on more (the batch must split over dp), so no count can be
        skipped."""
        per_node = self.device.devices_per_node
        return next((n for n in range((devices // per_node + 1) * per_node, MAX_DEVICES + 1, per_node)
                     if self._fits_on(n, batch)), None)

    def _fits_on(self, devices: int, batch: int) -> bool:
        for c in self.candidates(devices, batch, lightest=True):
            plan = memory_plan(self.m, c, self.seq_len, c.micro_batch_size, self.dtype, c.recompute,
                               self._flash(c.tp * c.cp * c.pp > 1), self._needs(c.micro_batch_size))
            if fits(plan, self.device):
                return True
        return False


def best_of(options: List[Option]) -> List[Option]:
    """The options that fit, in their order, less those a sibling beats: the same dp, tp, pp and micro-batches, no
    slower with no more memory (selective recompute where flash attention keeps no probabilities anyway; optimizer
    sharding never does, it costs no time here)."""
    fitting = [o for o in options if o.fits]
    siblings: Dict[tuple, List[Option]] = {}
    for o in fitting:
        siblings.setdefault(_key(o), []).append(o)

    def beaten(o: Option, group: List[Option]) -> bool:
        return any(x.time.step <= o.time.step and x.plan.total <= o.plan.total
                   and (x.time.step, x.plan.total) != (o.time.step, o.plan.total) for x in group)

    return [o for o in fitting if not beaten(o, siblings[_key(o)])]


def _key(o: Option) -> tuple:
    c = o.candidate
    return c.dp, c.tp, c.cp, c.pp, c.micro_batch_size, c.micro_batches


def summary_row(rank: int, o: Option, usable: float) -> Dict[str, str]:
    """One line of the ranked table."""
    c, t = o.candidate, o.time
    by_kind = {kind: sum(x.exposed for x in t.comms if x.kind == kind) for kind in COMM_KINDS}
    return {
        "#": str(rank), "layout": c.describe(), "mbs": str(c.micro_batch_size),
        "micro-batches": f"{c.micro_batches}" + (" (accum)" if c.pp == 1 and c.micro_batches > 1 else ""),
        "recompute": c.recompute, "memory GiB": f"{needed_bytes(o.plan) / 2 ** 30:.1f} ({needed_bytes(o.plan) / usable:.0%})",
        "bubble": f"{t.bubble_fraction:.0%}",
        f"comm s {'/'.join(COMM_KINDS)}": "/".join(f"{by_kind[k]:.2f}" for k in COMM_KINDS),
        "step s": f"{t.step:.3g}", "tokens/s/device": f"{t.tokens_per_s_per_device:,.0f}", "MFU": f"{t.mfu:.0%}",
    }


def format_table(rows: List[Dict[str, str]]) -> str:
    if not rows:
        return ""
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    lines = ["  ".join(k.ljust(widths[k]) for k in rows[0])]
    lines += ["  ".join(r[k].ljust(widths[k]) for k in r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
