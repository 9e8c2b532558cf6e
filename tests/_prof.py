import cProfile, pstats, sys, time
sys.path[:0]=['tests','.']
from conftest import compose_cfg
from planner.advisor import Search
cfg = compose_cfg("model=70b", "device=ascend910b", "nodes=16", "data.seq_len=4096", "dry_run=true")
t=time.time()
s=Search(cfg)
cProfile.run("r=s.ranked(128,1024)", "/tmp/prof")
print(time.time()-t)
p=pstats.Stats("/tmp/prof"); p.sort_stats("tottime").print_stats(12)
print(len(r), s.refused)
for o in r[:5]: print(o.candidate.describe(), o.candidate.micro_batch_size, o.candidate.micro_batches, o.candidate.recompute, round(o.time.step,3))
from planner.timing import format_time
o=r[0]; print(format_time(o.time, cfg.device, "bf16"))
import dataclasses
c=dataclasses.replace(o.candidate, zero3=False)
print(format_time(s.option(c).time, cfg.device, "bf16"))
