# The two set-up commands of the README. Each creates (once) the pinned venv outside the clone.
.PHONY: train test test-fast test-plain test-benchmarks device-check

# pytest-xdist worker processes. A test waiting on the processes it started (msrun launches, train.py runs) leaves
# its worker idle, so on a 2-core box the whole suite runs best with 3 workers: 782 s against 819 s with 2 (same
# code, one run each; 188% against 177% CPU). The fast tier starts few processes and runs best with 2: 282 s
# against 300 s. Each worker holds up to ~3 GB: lower them on a small-memory machine, raise them with more cores.
TEST_WORKERS ?= 3
FAST_TEST_WORKERS ?= 2

train:  ## pretrain model=tiny on the default real data (CPython stdlib + Shakespeare) on CPU
	scripts/venv.sh python train.py stage=tiny_pretrain

test:  ## the test suite (what .ci/run calls); a test file runs whole on one worker (its fixtures are shared), heaviest first
	scripts/venv.sh python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not benchmarks"

test-fast:  ## the suite without the tests marked slow (real training runs, launches), for development
	scripts/venv.sh python -m pytest -q -n $(FAST_TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

test-benchmarks:  ## every benchmark the docs name at its smallest setting: minutes each
	scripts/venv.sh python -m pytest -q -p no:xdist -m benchmarks tests/test_benchmarks.py

test-plain:  ## the fast tier on MindSpore's ops only (MINDLAB_KERNELS=plain): what runs where the CPU kernels do not
	scripts/venv.sh python -m pytest -q -n $(FAST_TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" --plain-ops

device-check:  ## on a new Ascend/GPU machine: tiny pretrain, SFT+LoRA, generation (and dp2xtp2xpp2 with 8 devices) against CPU fp32; with an NVIDIA driver, first the CUDA 11 / cuDNN 8 wheels MindSpore's GPU plugin links (scripts/gpu_runtime.py)
	scripts/venv.sh python scripts/gpu_runtime.py python -m benchmarks.device_check
