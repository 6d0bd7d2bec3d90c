"""Builds the nbhd C library (csrc/) as a plain shared object inside the package.

The library has no Python API and does not link libtorch: nbhd/_lib.py loads it with ctypes.
CUDA sources (csrc/cuda/*.cu) are compiled with nvcc when it is found; NBHD_CUDA_ARCH selects
the targets (default "80;90a"), NBHD_NO_CUDA=1 skips them.
"""
import glob
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
C_SOURCES = sorted(glob.glob("csrc/core/*.c") + glob.glob("csrc/cpu/*.c"))
CU_SOURCES = sorted(glob.glob("csrc/cuda/*.cu"))
INCLUDES = ["csrc/include", "csrc/core", "csrc/cpu"]


def find_nvcc():
    if os.environ.get("NBHD_NO_CUDA") == "1":
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def cuda_gencode_flags():
    flags = []
    for arch in os.environ.get("NBHD_CUDA_ARCH", "80;90a").replace(",", ";").split(";"):
        arch = arch.strip()
        if arch == "90":  # the Hopper kernels (fna_wgmma.cu) need the arch-specific target
            arch = "90a"
        if arch:
            flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def cuda_home_of(nvcc):
    """The toolkit folder holding libcudart: CUDA_HOME/CUDA_PATH, the folder above nvcc's bin (nvcc
    may be a wrapper script elsewhere, so also what `nvcc --dryrun` calls _TOP_), /usr/local/cuda*."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    try:
        out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True).stderr
        for line in out.splitlines():
            if "_TOP_=" in line:
                cands.append(os.path.realpath(line.split("_TOP_=", 1)[1].strip()))
    except OSError:
        pass
    cands += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for home in filter(None, cands):
        for d in ("lib64", "lib", "targets/x86_64-linux/lib"):
            if glob.glob(os.path.join(home, d, "libcudart.so*")):
                return home
    return cands[2]


class BuildNbhd(build_ext):
    """Adds nvcc-compiled objects for csrc/cuda when nvcc exists."""

    def build_extension(self, ext):
        nvcc = find_nvcc() if CU_SOURCES else None
        if nvcc:
            cuda_home = cuda_home_of(nvcc)
            objects = []
            os.makedirs(self.build_temp, exist_ok=True)
            jobs = []
            for src in CU_SOURCES:
                obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
                cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo",
                       "--expt-relaxed-constexpr", "-DNBHD_WITH_CUDA",
                       *[f"-I{i}" for i in INCLUDES], *cuda_gencode_flags(), "-c", src, "-o", obj]
                print(" ".join(cmd))
                jobs.append(subprocess.Popen(cmd))
                objects.append(obj)
            if any(j.wait() != 0 for j in jobs):
                raise RuntimeError("nvcc failed on csrc/cuda (see the messages above)")
            ext.extra_objects = objects
            ext.define_macros = [*ext.define_macros, ("NBHD_WITH_CUDA", "1")]
            lib_dirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
            ext.library_dirs = [d for d in lib_dirs if os.path.isdir(d)]
            ext.libraries = [*ext.libraries, "cudart", "stdc++"]  # nvcc host code needs the C++ runtime
            ext.runtime_library_dirs = ext.library_dirs
        super().build_extension(ext)

    def get_export_symbols(self, ext):
        return []  # a plain C library: no PyInit_ symbol


setup(
    ext_modules=[
        Extension(
            "nbhd._nbhd",
            sources=C_SOURCES,
            include_dirs=INCLUDES,
            extra_compile_args=["-std=c11", "-O3", "-fopenmp", "-fvisibility=hidden", "-Wall", "-Wno-psabi"],
            extra_link_args=["-fopenmp"],
            libraries=["m"],
        )
    ],
    cmdclass={"build_ext": BuildNbhd},
)
