"""`python -m l2l_hw.bench.gpu.wheels [DIR]`: the wheels the GPU campaign's peers need on the lent machine.

The lent GPU machine (Python 3.12, a CUDA torch, transformers, ninja, psutil, msgpack,
py-cpuinfo, einops, nvidia-ml-py; no network) lacks DeepSpeed and its pure-Python needs. This
builds them into DIR (default .whl, which .git/info/exclude must ignore) for the device tool's
`carry` (64 MiB with the working tree; the folder is ~8 MB):

  deepspeed       0.19.8 (pip wheel: its PyPI wheel, or one built from its sdist with DS_BUILD_OPS=0):
                  no op prebuilt; its CPU Adam is built on the machine on first use (ninja)
  hjson, pydantic, pydantic-core (cp312 manylinux), annotated-types, typing-inspection

On the machine, one command installs them beside the image's packages and runs a call of the
campaign (docs/GPU_CAMPAIGN.md, "Time budget and the device command", which builds DeepSpeed's
CPU Adam beside our extension first):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
      && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && python3 setup.py -q build_ext --inplace \\
      && python3 -m l2l_hw.cli bench gpu --out $OUT/gpu1 --work /tmp/w --time-limit 500 --parts matmul_peak regime_c
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# name==version: the versions the dry run runs here (requirements.txt pins deepspeed and hjson)
PURE = ("hjson==3.1.0", "annotated-types==0.8.0", "typing-inspection==0.4.5", "pydantic==2.14.4")
BINARY = ("pydantic-core==2.50.5",)  # compiled: the machine's CPython 3.12 on x86-64 Linux
DEEPSPEED = "deepspeed==0.19.8"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
LIMIT_BYTES = 48 * 2**20  # leaves the working tree 16 MiB of the carry's 64


def build(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    common = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
              "-d", str(folder)]
    subprocess.run([*pip, "download", *common, *PURE], check=True)
    subprocess.run([*pip, "download", *common, *[a for p in PLATFORMS for a in ("--platform", p)], *BINARY],
                   check=True)
    env = dict(os.environ, DS_BUILD_OPS="0")  # a pure-Python wheel: ops are built where they run
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), DEEPSPEED], check=True,
                   env=env)
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if size > LIMIT_BYTES:
        raise SystemExit(f"{folder}: {size / 2**20:.1f} MiB of wheels, over {LIMIT_BYTES / 2**20:.0f} MiB")
    return wheels


if __name__ == "__main__":
    for wheel in build(Path(sys.argv[1] if len(sys.argv) > 1 else ".whl")):
        print(f"{wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
