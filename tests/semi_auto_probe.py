"""Run by tests/test_semi_auto.py under msrun: the tp/pp training path of trainer/loop.py on CPU, called
directly (train.py's validation refuses tp/pp on CPU), to show how far it gets here. Prints one line
`probe: <outcome>` and exits 0 when the first step stops at MindSpore's parallel compiler."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, as pytest.ini does
from conftest import compose_cfg  # noqa: E402  (tests/ is this script's directory)

from trainer.loop import train  # noqa: E402

cfg = compose_cfg("model=tiny", "data.seq_len=64", "trainer.micro_batch_size=2", "trainer.max_steps=1",
                  "trainer.eval_batches=1", "logger.progress_bar=false", *sys.argv[2:])
try:
    train(cfg, sys.argv[1])
    print("probe: the sharded step ran", flush=True)
except RuntimeError as err:
    print(f"probe: {str(err).splitlines()[0]}", flush=True)
