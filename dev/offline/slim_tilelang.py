"""Pack TileLang and its native dependencies slim enough to travel to an offline GPU machine beside FlashQLA.

FlashQLA (``flash-qla``, the Qwen team's fused TileLang forward and backward of the gated delta rule)
is the backend fla 0.6's ``chunk_gated_delta_rule`` hands bf16/fp16 calls with 128-wide heads to
on SM90/SM100 (fla/ops/gated_delta_rule/backends/flash_qla.py). It is pure Python (0.13 MB) but
needs TileLang, whose manylinux wheel is 49.5 MB and whose ``libtvm_compiler.so`` links
``libz3.so.4.15`` from ``z3-solver`` (29 MB wheel) and ``libtvm_ffi.so`` from ``apache-tvm-ffi``:
about 83 MB of wheels, more than the 64 MiB a device call carries. Installed, that is 245 MB, of which
a JIT run reads the shared libraries, TVM's Python package, TileLang's CUDA templates and CUTLASS's
headers. This script unpacks the three wheels into one site-packages tree and drops:

* TVM's and TileLang's C++ sources (``3rdparty/tvm/src``, ``src/`` but ``src/tl_templates``, the
  kernels' include root), CUTLASS's ``tools/`` (profiler, test utilities);
* TileLang's Ascend templates (``src/tl_templates/ascend``: another vendor's device code);
* z3's headers, its ``bin/`` and its duplicate ``libz3.so`` (a symlink to ``libz3.so.4.15`` instead:
  TileLang's libraries find it through their RUNPATH ``$ORIGIN/../../z3/lib``);
* tvm-ffi's headers and Cython sources (not its test library: ``core.abi3.so`` links it);

keeps the stripped shared libraries as they are (the wheels' are already stripped), and writes them
as one ``tar.xz`` to unpack into the install target (``tar xJf ... -C /tmp/site``). The small pure or
abi3 dependencies (cloudpickle, ml-dtypes, psutil, torch-c-dlpack-ext) and flash-qla stay wheels.

    mkdir -p /tmp/tl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d /tmp/tl \\
        tilelang==0.1.15 "apache-tvm-ffi>=0.1.11,<0.1.13" "z3-solver>=4.13,<4.15.5" \\
        flash-qla==0.1.3 cloudpickle ml-dtypes psutil torch-c-dlpack-ext
    python3 dev/offline/slim_tilelang.py /tmp/tl .whl-qla/

``--check`` imports tilelang (and tvm, tvm_ffi, z3's library through the RUNPATH) from the unpacked tarball.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

#: Whole subtrees dropped, relative to the site-packages root.
DROP_TREES = (
    "tilelang/3rdparty/tvm/src",
    "tilelang/3rdparty/cutlass/tools",
    "tilelang/src/tl_templates/ascend",
    "z3/include",
    "z3/bin",
    "tvm_ffi/include",
    "tvm_ffi/cython",
)
#: Single files dropped.
DROP_FILES = ("z3/lib/libz3.so",)  # tvm_ffi/lib/libtvm_ffi_testing.so stays: its core links it
#: The wheels unpacked into the tarball (the rest of the folder is copied as wheels).
NATIVE = ("tilelang-", "apache_tvm_ffi-", "z3_solver-")
SMALL = ("flash_qla-", "cloudpickle-", "ml_dtypes-", "psutil-", "torch_c_dlpack_ext-")


def prune(site: Path) -> None:
    for tree in DROP_TREES:
        shutil.rmtree(site / tree, ignore_errors=True)
    for name in DROP_FILES:
        (site / name).unlink(missing_ok=True)
    # TileLang's own C++ sources: everything under src/ but the templates the kernels include
    for child in (site / "tilelang/src").iterdir():
        if child.name != "tl_templates":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    os.symlink("libz3.so.4.15", site / "z3/lib/libz3.so")
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    # RECORD names dropped files: drop it (pip never reads it back from a tarball-installed tree)
    for record in site.glob("*.dist-info/RECORD"):
        record.unlink()


def pack(wheels: Path, out_dir: Path) -> Path:
    natives = [w for prefix in NATIVE for w in wheels.glob(f"{prefix}*.whl")]
    if len(natives) != len(NATIVE):
        raise SystemExit(f"need one wheel each of {NATIVE} in {wheels}, found {[w.name for w in natives]}")
    version = next(w for w in natives if w.name.startswith("tilelang-")).name.split("-")[1]
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        for wheel in natives:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        for so in site.rglob("*.so*"):
            so.chmod(0o755)
        prune(site)
        tar = out_dir / f"tilelang-{version}-slim.tar"
        with tarfile.open(tar, "w") as t:
            for child in sorted(site.iterdir()):
                t.add(child, arcname=child.name)
        # xz -9e: the libraries are most of it (multi-threaded xz compresses a little worse)
        subprocess.run(["xz", "-9e", "-f", "-T1", str(tar)], check=True)
    for prefix in SMALL:
        for wheel in wheels.glob(f"{prefix}*.whl"):
            shutil.copy(wheel, out_dir / wheel.name)
    return out_dir / f"tilelang-{version}-slim.tar.xz"


CHECK = """
import tilelang, tvm, tvm_ffi
from tilelang import language as T
print("tilelang", tilelang.__version__, "tvm_ffi", tvm_ffi.__version__)
"""


def check(tarball: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["tar", "xJf", str(tarball), "-C", tmp], check=True)
        env = {**os.environ, "PYTHONPATH": tmp + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, "-c", CHECK], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path, help="folder with the downloaded wheels")
    parser.add_argument("out_dir", type=Path, help="e.g. .whl-qla/")
    parser.add_argument("--check", action="store_true", help="import tilelang from the result (needs torch)")
    args = parser.parse_args()
    tarball = pack(args.wheels, args.out_dir)
    print(f"{tarball}: {tarball.stat().st_size / 2**20:.1f} MiB")
    if args.check:
        check(tarball)


if __name__ == "__main__":
    main()
