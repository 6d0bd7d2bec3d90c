"""Instructions per iteration of the Hopper kernels' main loops, from their SASS: for each kernel
whose demangled name contains every given substring, the innermost loop that holds a wgmma
(HGMMA) and its instruction count by opcode. The counts are static (both sides of a branch
inside the loop count), per warp and iteration (one key or query tile).

    python scripts/sass_loops.py OBJECT_OR_LIBRARY SUBSTRING... [--top 14]
    python scripts/sass_loops.py build/.../fna_wgmma_bwd.cu.o "dkdv_kernel<__nv_bfloat16, 128, 32, 2,"

Needs `cuobjdump` (with `nvdisasm` beside it or on PATH) from the CUDA toolkit, found on PATH or
under $CUDA_HOME/bin; `c++filt` demangles. docs/kernels.md §3 quotes its counts.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def parse(function_sass: str) -> List[Tuple[int, str]]:
    """(address, instruction text) of each SASS line of one function."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, function_sass.split("\n")) if m]


def opcode(text: str) -> str:
    """The instruction's opcode without its predicate and modifiers: '@!P0 IMAD.WIDE ...' -> 'IMAD'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(instructions: List[Tuple[int, str]], marker: str = "HGMMA") -> Optional[Tuple[int, int]]:
    """(first, last address) of the shortest backward branch's span that holds an instruction
    containing `marker`: the innermost loop around the tensor-core products; None without one."""
    marked = [a for a, t in instructions if marker in t]
    loops = []
    for a, t in instructions:
        m = _BRANCH_TARGET.search(t)
        if m:
            target = int(m.group(1), 16)
            if target < a and any(target <= h <= a for h in marked):
                loops.append((a - target, target, a))
    if not loops:
        return None
    _, first, last = min(loops)
    return first, last


def loop_counts(function_sass: str) -> Optional[Dict[str, int]]:
    """Instructions of the main loop (main_loop) by opcode, most frequent first; None without a loop."""
    instructions = parse(function_sass)
    span = main_loop(instructions)
    if span is None:
        return None
    counts = collections.Counter(opcode(t) for a, t in instructions if span[0] <= a <= span[1])
    return dict(counts.most_common())


def functions(sass: str) -> Dict[str, str]:
    """Mangled name -> that function's SASS, from cuobjdump -sass output."""
    parts = re.split(r"\n\s*Function : ", sass)[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def _tool(name: str) -> str:
    found = shutil.which(name) or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)
    if not os.path.exists(found):
        sys.exit(f"sass_loops.py: {name} not found on PATH or in $CUDA_HOME/bin")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("object", help="an object file or shared library with sm_90a code")
    ap.add_argument("names", nargs="+", help="substrings that the demangled kernel name must all contain")
    ap.add_argument("--top", type=int, default=14, help="opcodes printed per kernel")
    args = ap.parse_args()
    cuobjdump = _tool("cuobjdump")
    env = dict(os.environ, PATH=os.environ.get("PATH", "") + os.pathsep + os.path.dirname(cuobjdump))
    sass = subprocess.run([cuobjdump, "-sass", args.object], capture_output=True, text=True, env=env,
                          check=True).stdout
    found = 0
    for mangled, text in functions(sass).items():
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
        if not all(s in name for s in args.names):
            continue
        found += 1
        counts = loop_counts(text)
        if counts is None:
            print(f"{name}\n  no loop around a wgmma")
            continue
        top = ", ".join(f"{op} {n}" for op, n in list(counts.items())[:args.top])
        print(f"{name}\n  main loop: {sum(counts.values())} instructions ({top})")
    if not found:
        sys.exit("sass_loops.py: no kernel matches " + " and ".join(repr(s) for s in args.names))


if __name__ == "__main__":
    main()
