"""mindlab's compiled CPU kernels: C++ sources here, built into the venv as MindSpore AOT custom ops.

    attention.cc   causal self-attention forward and backward, and a decoding step against a KV cache
                   (kernels/attention.py: their MindSpore ops)
    layers.cc      RMSNorm, SwiGLU, RoPE and cross-entropy forward and backward, and a Linear's products
                   (kernels/layers.py: their ops)
    optimizer.cc   the gradient norm and AdamW's in-place update, each over all parameters in one op
                   (kernels/optimizer.py: their ops; trainer/fused_adamw.py FusedAdamW)
    threads.h      the thread-per-core helpers they use
    sgemm.h        oneDNN's sgemm, for attention.cc's and layers.cc's products
    stream.h       non-temporal stores, for the backward kernels' outputs
    rope.h         one row of RoPE, for layers.cc's RoPE op and attention.cc's decoding step

scripts/venv.sh runs `python -m kernels` after creating or finding the venv: each source is compiled once into
<venv>/mindlab-kernels/<name>-<key>.so, the key hashing the source and the headers, the compile command (without the
checkout's path: every clone sharing the venv shares the build) and this CPU's flags (-march=native code would crash
on another CPU kind). Building needs an x86 host (the sources use AVX intrinsics; on an ARM server, such as those
hosting Ascend cards, nothing is built and one line says why), g++ and oneDNN's libdnnl.so.3, which the MindSpore
wheel ships (the kernels call its sgemm). Without them the models use their plain MindSpore ops
(model.attention_kernel=auto) or say why they cannot (=fused), and AdamW uses MindSpore's fused kernel per
parameter. MINDLAB_KERNELS=plain turns every library off (`library` answers None), e.g. to run the tests on the
plain ops (tests/conftest.py --plain-ops).

Importing this module is cheap: no MindSpore.
"""
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from typing import Optional, Tuple

from base.errors import UserError

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("attention", "layers", "optimizer")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-pthread", "-shared", "-fPIC", "-std=c++17"]
SWITCH = "MINDLAB_KERNELS"  # "plain": every model, loss and optimizer on MindSpore's ops


def _mindspore_lib() -> Optional[str]:
    """MindSpore's bundled library folder (holding libdnnl.so.3), found without importing MindSpore."""
    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    return lib if os.path.exists(os.path.join(lib, "libdnnl.so.3")) else None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _not_x86() -> Optional[str]:
    """Why nothing is built on this host (one line), or None on x86."""
    machine = platform.machine()
    if machine.lower() in ("x86_64", "amd64", "i386", "i686"):
        return None
    return (f"kernels/ is x86 code (AVX intrinsics) and this host is {machine or 'of an unknown kind'}: nothing is "
            "built, the models use their plain MindSpore ops")


def switched_off() -> Optional[str]:
    """Why MINDLAB_KERNELS turns the libraries off (one line), or None; an unknown value is a UserError."""
    value = os.environ.get(SWITCH, "")
    if value == "plain":
        return f"{SWITCH}=plain turns the compiled kernels off (unset it to use them)"
    if value:
        raise UserError(f"{SWITCH}={value}: set it to plain (MindSpore's ops everywhere) or unset it (the kernels "
                        "where they apply)")
    return None


def _command(name: str, lib: str, out: str, source_dir: str = HERE) -> list:
    return ["g++", *FLAGS, os.path.join(source_dir, f"{name}.cc"), "-o", out, f"-L{lib}", "-l:libdnnl.so.3",
            f"-Wl,-rpath,{lib}"]


def library(name: str) -> Tuple[Optional[str], str]:
    """(path of the built library, "") or (None, why it is not there: one line with the fix)."""
    why = switched_off() or _not_x86()
    if why:
        return None, why
    lib = _mindspore_lib()
    if lib is None:
        return None, "MindSpore's libdnnl.so.3 (the kernels' sgemm) was not found in this environment"
    path = library_path(name, lib)
    if os.path.exists(path):
        return path, ""
    if shutil.which("g++") is None:
        return None, f"kernels/{name}.cc is not built: no g++ on PATH (install one, then run scripts/venv.sh true)"
    return None, f"kernels/{name}.cc is not built for this source and CPU: run scripts/venv.sh true"


def fingerprint() -> str:
    """The libraries in use (their paths, or None), for a cache of compiled graphs (trainer/runtime.py): a graph
    names its library's path, which follows the source and the CPU."""
    return " ".join(str(library(name)[0]) for name in SOURCES)


def build() -> None:
    """Compile every source whose library is missing; a failure is reported in one line, never raised (the
    models fall back to their plain ops)."""
    why = _not_x86()
    if why:
        print(f"[mindlab] {why}", file=sys.stderr)
        return
    lib = _mindspore_lib()
    if lib is None or shutil.which("g++") is None:
        return
    for name in SOURCES:
        path = library_path(name, lib)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
            out = os.path.join(tmp, os.path.basename(path))
            done = subprocess.run(_command(name, lib, out), capture_output=True, text=True)
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["?"])[0]
                print(f"[mindlab] kernels/{name}.cc did not compile ({first}); plain MindSpore ops are used",
                      file=sys.stderr)
                continue
            os.replace(out, path)  # atomic: a reader never sees half a library
        print(f"[mindlab] built kernels/{name}.cc -> {path}", file=sys.stderr)


def library_path(name: str, lib: str, source_dir: str = HERE) -> str:
    """<venv>/mindlab-kernels/<name>-<hash of the source and the headers, the compile command and the CPU's
    flags>.so. The command enters the hash with the source named relative to its checkout (kernels/<name>.cc), so
    that every clone of the same source finds the same library."""
    command = _command(name, lib, "", source_dir="kernels")
    key = hashlib.sha256(" ".join(command).encode() + _cpu_flags().encode())
    for source in [f"{name}.cc", *sorted(f for f in os.listdir(source_dir) if f.endswith(".h"))]:
        with open(os.path.join(source_dir, source), "rb") as f:
            key.update(f.read())
    return os.path.join(sys.prefix, "mindlab-kernels", f"{name}-{key.hexdigest()[:16]}.so")
