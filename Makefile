# The two set-up commands of the README. Each creates (once) the pinned venv outside the clone.
.PHONY: train test test-fast

# pytest-xdist worker processes: MindSpore compiles graphs on one core, so two workers keep a 2-core box busy
# (benchmark: 1.3x on the compile-heavy tests). Each worker holds up to ~3 GB; raise it on bigger machines.
TEST_WORKERS ?= 2

train:  ## pretrain model=tiny on the default real data (CPython stdlib + Shakespeare) on CPU
	scripts/venv.sh python train.py experiment=tiny_pretrain

test:  ## the test suite (what .ci/run calls); a test file runs whole on one worker (its fixtures are shared)
	scripts/venv.sh python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast:  ## the suite without the tests marked slow (real training runs, launches), for development
	scripts/venv.sh python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"
