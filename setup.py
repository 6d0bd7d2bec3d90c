"""Builds the nbhd C library (csrc/) as a plain shared object inside the package.

The library has no Python API and does not link libtorch: nbhd/_lib.py loads it with ctypes.
The C sources compile in parallel (NBHD_BUILD_JOBS, default: the CPU count).

CUDA kernels (csrc/cuda/*.cu, with nvcc) are built only when asked for or useful:
  NBHD_CUDA=1      build them (fails without nvcc)
  NBHD_CUDA=0      never build them
  unset            build them when nvcc is found and either a GPU is present (nvidia-smi lists
                   one, or /dev/nvidia0 exists) or NBHD_CUDA_ARCH is set
NBHD_CUDA_ARCH selects the targets (default "80;90a"). They take far longer to compile than the
C library, so a machine without a GPU skips them unless told.
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
C_SOURCES = sorted(glob.glob("csrc/core/*.c") + glob.glob("csrc/cpu/*.c") + glob.glob("csrc/cpu/fast/*.c")
                   + glob.glob("csrc/cpu/amx/*.c") + glob.glob("csrc/cpu/scalar/*.c"))
CU_SOURCES = sorted(glob.glob("csrc/cuda/*.cu"))
INCLUDES = ["csrc/include", "csrc/core", "csrc/cpu"]


def find_nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def gpu_present():
    if os.path.exists("/dev/nvidia0"):
        return True
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def cuda_nvcc():
    """nvcc when the CUDA kernels are to be built (the module docstring's rule), else None."""
    switch = os.environ.get("NBHD_CUDA", "").strip()
    if switch not in ("", "0", "1"):
        raise RuntimeError(f"NBHD_CUDA={switch!r}: use 1 (build the CUDA kernels), 0 (skip them) "
                           "or leave it unset (build them when a GPU or NBHD_CUDA_ARCH is present)")
    if switch == "0" or not CU_SOURCES:
        return None
    nvcc = find_nvcc()
    if switch == "1":
        if not nvcc:
            raise RuntimeError("NBHD_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        return nvcc
    if nvcc and (os.environ.get("NBHD_CUDA_ARCH") or gpu_present()):
        return nvcc
    if nvcc:
        print("nbhd: nvcc found but no GPU and no NBHD_CUDA_ARCH: building the CPU library only "
              "(NBHD_CUDA=1 builds the CUDA kernels)")
    return None


def compile_in_parallel(compiler, jobs, then=lambda: None):
    """Makes compiler.compile build its sources `jobs` at a time (one gcc per source), then
    call `then` (waiting for the nvcc jobs) before the link."""
    serial = compiler.compile

    def compile(sources, *args, **kwargs):
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            objects = [o for objs in pool.map(lambda src: serial([src], *args, **kwargs), sources)
                       for o in objs]
        then()
        return objects

    compiler.compile = compile


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


def cuda_object_current(cmd, src, obj):
    """Whether obj was built by this exact nvcc command (kept beside it in obj + ".cmd") and is
    newer than its source and every header below csrc/: then it is not compiled again, so that a
    kept build folder (`setup.py build_ext --inplace -t DIR`) rebuilds only the CUDA sources a
    change touches."""
    stamp = obj + ".cmd"
    if not (os.path.isfile(obj) and os.path.isfile(stamp)):
        return False
    with open(stamp) as f:
        if f.read() != " ".join(cmd):
            return False
    headers = [h for ext in ("h", "cuh") for h in glob.glob(os.path.join("csrc", "**", "*." + ext), recursive=True)]
    return os.path.getmtime(obj) > max(os.path.getmtime(f) for f in [src, *headers])


class BuildNbhd(build_ext):
    """Compiles the C sources in parallel; adds nvcc-compiled objects for csrc/cuda when the
    CUDA kernels are built (cuda_nvcc)."""

    def build_extension(self, ext):
        nvcc = cuda_nvcc()
        nvcc_jobs = []
        if nvcc:   # nvcc runs while gcc compiles the C sources; the link waits for both
            cuda_home = cuda_home_of(nvcc)
            os.makedirs(self.build_temp, exist_ok=True)
            objects = []
            for src in CU_SOURCES:
                obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
                cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo",
                       "--expt-relaxed-constexpr", "-DNBHD_WITH_CUDA",
                       *[f"-I{i}" for i in INCLUDES], *cuda_gencode_flags(), "-c", src, "-o", obj]
                objects.append(obj)
                if cuda_object_current(cmd, src, obj):
                    print(f"{obj}: up to date")
                    continue
                print(" ".join(cmd))
                if os.path.exists(obj + ".cmd"):
                    os.remove(obj + ".cmd")  # written again only once this command has succeeded
                nvcc_jobs.append((subprocess.Popen(cmd), cmd, obj))
            ext.extra_objects = objects
            ext.define_macros = [*ext.define_macros, ("NBHD_WITH_CUDA", "1")]
            lib_dirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
            ext.library_dirs = [d for d in lib_dirs if os.path.isdir(d)]
            ext.libraries = [*ext.libraries, "cudart", "stdc++"]  # nvcc host code needs the C++ runtime
            ext.runtime_library_dirs = ext.library_dirs

        def wait_for_nvcc():
            failed = False
            for job, cmd, obj in nvcc_jobs:
                if job.wait() == 0:
                    with open(obj + ".cmd", "w") as f:
                        f.write(" ".join(cmd))
                failed = failed or job.returncode != 0
            nvcc_jobs.clear()
            if failed:
                raise RuntimeError("nvcc failed on csrc/cuda (see the messages above)")

        compile_in_parallel(self.compiler, int(os.environ.get("NBHD_BUILD_JOBS") or os.cpu_count() or 1),
                            then=wait_for_nvcc)
        if nvcc_jobs:  # build_ext skips the link when the library is newer than the C sources
            self.force = True
        try:
            super().build_extension(ext)
        finally:
            wait_for_nvcc()

    def get_export_symbols(self, ext):
        return []  # a plain C library: no PyInit_ symbol



if __name__ == "__main__":   # setup.py's helpers can be imported (tests/test_build.py)
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
