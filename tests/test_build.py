"""The build: the CUDA kernels are built only when asked for or useful (setup.py's docstring),
the C sources compile as separate objects in parallel (setup.py and the Makefile)."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def setup_py(monkeypatch):
    if not os.path.isfile(os.path.join(ROOT, "setup.py")):
        pytest.skip("needs the source tree")
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("nbhd_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # defines the helpers; setup() runs only as __main__
    for name in ("NBHD_CUDA", "NBHD_CUDA_ARCH"):
        monkeypatch.delenv(name, raising=False)
    return module


@pytest.mark.parametrize("switch,arch,gpu,nvcc,built", [
    (None, None, False, "/usr/bin/nvcc", False),   # nvcc alone does not build CUDA
    (None, None, True, "/usr/bin/nvcc", True),     # a GPU does
    (None, "90a", False, "/usr/bin/nvcc", True),   # so does an explicit arch list
    (None, None, True, None, False),               # no nvcc: CPU only
    ("0", "90a", True, "/usr/bin/nvcc", False),
    ("1", None, False, "/usr/bin/nvcc", True),
])
def test_cuda_build_is_explicit(setup_py, monkeypatch, switch, arch, gpu, nvcc, built):
    if switch is not None:
        monkeypatch.setenv("NBHD_CUDA", switch)
    if arch is not None:
        monkeypatch.setenv("NBHD_CUDA_ARCH", arch)
    monkeypatch.setattr(setup_py, "gpu_present", lambda: gpu)
    monkeypatch.setattr(setup_py, "find_nvcc", lambda: nvcc)
    assert setup_py.cuda_nvcc() == (nvcc if built else None)


def test_cuda_switch_errors(setup_py, monkeypatch):
    monkeypatch.setattr(setup_py, "find_nvcc", lambda: None)
    monkeypatch.setenv("NBHD_CUDA", "1")
    with pytest.raises(RuntimeError, match="NBHD_CUDA=1 but nvcc was not found"):
        setup_py.cuda_nvcc()
    monkeypatch.setenv("NBHD_CUDA", "yes")
    with pytest.raises(RuntimeError, match="NBHD_CUDA='yes': use 1"):
        setup_py.cuda_nvcc()


def test_setup_compiles_each_source_on_its_own_in_parallel(setup_py):
    import threading
    import time

    calls, active, peak = [], [0], [0]
    lock = threading.Lock()

    class Compiler:
        def compile(self, sources, output_dir=None, **kwargs):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.05)
            with lock:
                active[0] -= 1
            calls.append(list(sources))
            return [s + ".o" for s in sources]

    compiler = Compiler()
    waited = []
    setup_py.compile_in_parallel(compiler, 2, then=lambda: waited.append(True))
    objects = compiler.compile(setup_py.C_SOURCES, output_dir="build")
    assert objects == [s + ".o" for s in setup_py.C_SOURCES]
    assert all(len(c) == 1 for c in calls) and len(calls) == len(setup_py.C_SOURCES)
    assert peak[0] == 2 and waited == [True]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_builds_one_object_per_source():
    dry = subprocess.run(["make", "-n", "-B", "build/c/libnbhd.so"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    compiled = re.findall(r" -c (csrc/\S+\.c) -o build/c/obj/(\S+)\.o", dry.stdout)
    sources = sorted(os.path.relpath(os.path.join(d, f), ROOT)
                     for top in (os.path.join(ROOT, "csrc/core"), os.path.join(ROOT, "csrc/cpu"))
                     for d, _, files in os.walk(top) for f in files if f.endswith(".c"))
    assert sorted(src for src, _ in compiled) == sources
    assert all(src == f"csrc/{obj}.c" for src, obj in compiled)


def test_setup_compiles_every_c_source(setup_py):
    """pip's build (setup.py) compiles the same C sources as the Makefile: every .c below csrc/core
    and csrc/cpu, subfolders (fast/, amx/, scalar/) included"""
    sources = sorted(os.path.relpath(os.path.join(d, f), ROOT)
                     for top in (os.path.join(ROOT, "csrc/core"), os.path.join(ROOT, "csrc/cpu"))
                     for d, _, files in os.walk(top) for f in files if f.endswith(".c"))
    assert sorted(setup_py.C_SOURCES) == sources


def test_cuda_object_kept_only_when_its_command_and_inputs_are_unchanged(setup_py, tmp_path):
    """A kept build folder rebuilds only the CUDA objects a change touches: an object is current
    when the stamp beside it holds the same nvcc command and it is newer than its source and
    every header below csrc/"""
    src = "csrc/cuda/merge.cu"
    obj = str(tmp_path / "merge.cu.o")
    cmd = ["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-c", src, "-o", obj]
    assert not setup_py.cuda_object_current(cmd, src, obj)  # no object
    with open(obj, "w") as f:
        f.write("object")
    assert not setup_py.cuda_object_current(cmd, src, obj)  # no stamp: a build that failed or never finished
    with open(obj + ".cmd", "w") as f:
        f.write(" ".join(cmd))
    newest = max(os.path.getmtime(p) for p in [src, *glob.glob("csrc/**/*.h", recursive=True),
                                               *glob.glob("csrc/**/*.cuh", recursive=True)])
    os.utime(obj, (newest + 10, newest + 10))
    assert setup_py.cuda_object_current(cmd, src, obj)
    other = [*cmd[:2], "-gencode=arch=compute_80,code=sm_80", *cmd[3:]]
    assert not setup_py.cuda_object_current(other, src, obj)  # another target
    os.utime(obj, (newest - 10, newest - 10))
    assert not setup_py.cuda_object_current(cmd, src, obj)  # a source or header changed since
