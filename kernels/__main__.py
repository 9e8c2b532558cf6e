"""`python -m kernels`: build the missing kernels (scripts/venv.sh runs it)."""
from kernels import build

build()
