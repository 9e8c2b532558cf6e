# The two set-up commands of the README. Each creates (once) the pinned venv outside the clone.
.PHONY: train test test-fast

train:  ## pretrain model=tiny on the default real data (CPython stdlib + Shakespeare) on CPU
	scripts/venv.sh python train.py experiment=tiny_pretrain

test:  ## the test suite (what .ci/run calls)
	scripts/venv.sh python -m pytest -q

test-fast:  ## the suite without the tests marked slow (real training runs, launches), for development
	scripts/venv.sh python -m pytest -q -m "not slow"
