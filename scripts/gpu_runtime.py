"""Run a command where MindSpore's GPU plugin can load: `make device-check` runs the device check through it.

    scripts/venv.sh python scripts/gpu_runtime.py python -m benchmarks.device_check    # what make device-check does
    scripts/venv.sh python scripts/gpu_runtime.py --plan                                # what it would install and set

MindSpore 2.9's GPU plugin (mindspore/lib/plugin/libmindspore_gpu.so.11.6) links CUDA 11 and cuDNN 8 libraries
that only a CUDA toolkit install puts on a machine; the driver brings libcuda.so.1 alone. NVIDIA publishes each of
them as a wheel (LIBRARIES below), so on a machine with an NVIDIA driver this installs those wheels into the venv
(scripts/gpu-requirements.txt, pinned: cuDNN 8.x, which the plugin links) and runs the command with their lib/
directories on LD_LIBRARY_PATH (the loader reads it at process start, hence a new process). On a machine without
the driver (CPU, Ascend) the command runs as it is, and the device check says in one line that there is no device.
`--gpu` asks for the GPU set-up whatever the machine: without the driver that is refused in one line.
"""
import argparse
import os
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIREMENTS = os.path.join(HERE, "gpu-requirements.txt")
# soname the GPU plugin links -> (wheel, its directory under site-packages/nvidia/)
LIBRARIES = {
    "libcublas.so.11": ("nvidia-cublas-cu11", "cublas"),
    "libcudnn.so.8": ("nvidia-cudnn-cu11", "cudnn"),
    "libcudart.so.11.0": ("nvidia-cuda-runtime-cu11", "cuda_runtime"),
    "libcusolver.so.11": ("nvidia-cusolver-cu11", "cusolver"),
    "libcufft.so.10": ("nvidia-cufft-cu11", "cufft"),
    "libcurand.so.10": ("nvidia-curand-cu11", "curand"),
    "libcusparse.so.11": ("nvidia-cusparse-cu11", "cusparse"),
    "libnvrtc.so.11.2": ("nvidia-cuda-nvrtc-cu11", "cuda_nvrtc"),
}
DRIVER = "libcuda.so.1"  # comes with the NVIDIA driver, never from a wheel


def has_driver() -> bool:
    """An NVIDIA kernel driver is loaded and its user-space library is where the loader finds it."""
    if not os.path.exists("/proc/driver/nvidia/version"):
        return False
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return any(line.strip().startswith(DRIVER + " ") for line in listed.splitlines())


def library_path(site_packages: str = sysconfig.get_paths()["purelib"]) -> list:
    """The lib/ directories the wheels install, in LIBRARIES' order."""
    return [os.path.join(site_packages, "nvidia", folder, "lib") for _, folder in LIBRARIES.values()]


def pinned() -> dict:
    """{wheel: version} of scripts/gpu-requirements.txt."""
    out = {}
    with open(REQUIREMENTS, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                out[name] = version
    return out


def install() -> None:
    """pip install the pinned wheels into this venv, once (a marker records the file's contents)."""
    marker = os.path.join(sys.prefix, ".gpu-libs")
    want = open(REQUIREMENTS, encoding="utf-8").read()
    if os.path.exists(marker) and open(marker, encoding="utf-8").read() == want:
        return
    print(f"[gpu] installing the CUDA 11 / cuDNN 8 libraries of {os.path.relpath(REQUIREMENTS)} into {sys.prefix}",
          file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", REQUIREMENTS], check=True)
    with open(marker, "w", encoding="utf-8") as f:
        f.write(want)


def environment(env: dict) -> dict:
    """`env` with the wheels' lib/ directories first on LD_LIBRARY_PATH."""
    return {**env, "LD_LIBRARY_PATH": os.pathsep.join([*library_path(), *filter(None, [env.get("LD_LIBRARY_PATH")])])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_runtime.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", action="store_true", help="print the wheels and LD_LIBRARY_PATH, install nothing")
    p.add_argument("--gpu", action="store_true", help="set up for the GPU plugin even where no driver is found")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    driver = has_driver()
    if args.plan:
        print("driver: " + ("found" if driver else f"none ({DRIVER} and /proc/driver/nvidia absent)"))
        print("wheels: " + " ".join(f"{name}=={version}" for name, version in pinned().items()))
        print("LD_LIBRARY_PATH: " + environment({})["LD_LIBRARY_PATH"])
        return 0
    if not args.command:
        p.error("give the command to run, e.g. python -m benchmarks.device_check")
    if args.gpu and not driver:
        print(f"gpu runtime: no NVIDIA driver on this machine ({DRIVER} is not on the loader's path and "
              "/proc/driver/nvidia is absent): install the driver first; the CUDA libraries come from the venv",
              file=sys.stderr)
        return 1
    env = dict(os.environ)
    if driver:
        install()
        env = environment(env)
    os.execvpe(args.command[0], args.command, env)


if __name__ == "__main__":
    sys.exit(main())
