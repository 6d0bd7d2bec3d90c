"""Instructions per iteration of the Hopper kernels' main loops, from their SASS: for each kernel
whose demangled name contains every given substring, the innermost loop that holds a wgmma
(HGMMA) and its instruction count by opcode. The counts are static (both sides of a branch
inside the loop count), per warp and iteration (one key or query tile).

    python scripts/sass_loops.py OBJECT_OR_LIBRARY SUBSTRING... [--top 14] [--against OTHER]
    python scripts/sass_loops.py build/.../fna_wgmma_bwd.cu.o "dkdv_kernel<__nv_bfloat16, 128, 32, 2,"

--against OTHER compares each kernel's loop with the same kernel's (the same name up to its
parameter list) in another build: the counts' difference and how alike the two loops' opcode
sequences are (1 = the same order). Two builds can issue the same instructions in another
order, and that alone has moved a kernel's time by a few per cent (docs/kernels.md §3).

Needs `cuobjdump` (with `nvdisasm` beside it or on PATH) from the CUDA toolkit, found on PATH or
under $CUDA_HOME/bin; `c++filt` demangles. docs/kernels.md §3 quotes its counts.
"""
import argparse
import collections
import difflib
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


def loop_opcodes(function_sass: str) -> Optional[List[str]]:
    """The main loop's (main_loop) opcodes in address order; None without a loop."""
    instructions = parse(function_sass)
    span = main_loop(instructions)
    if span is None:
        return None
    return [opcode(t) for a, t in instructions if span[0] <= a <= span[1]]


def loop_counts(function_sass: str) -> Optional[Dict[str, int]]:
    """Instructions of the main loop by opcode, most frequent first; None without a loop."""
    ops = loop_opcodes(function_sass)
    return None if ops is None else dict(collections.Counter(ops).most_common())


def order_likeness(a: List[str], b: List[str]) -> float:
    """How alike two opcode sequences are in order: 2 * matched / (len a + len b), 1 = identical."""
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


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
    ap.add_argument("--against", help="another build's object or library: compare each loop with its kernel's there")
    args = ap.parse_args()
    cuobjdump = _tool("cuobjdump")
    env = dict(os.environ, PATH=os.environ.get("PATH", "") + os.pathsep + os.path.dirname(cuobjdump))

    def kernels(obj: str) -> Dict[str, str]:
        """demangled name -> SASS of the kernels of obj whose names hold every substring"""
        sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, env=env, check=True).stdout
        out = {}
        for mangled, text in functions(sass).items():
            name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
            if all(s in name for s in args.names):
                out[name] = text
        return out

    other = {name.split("(")[0]: text for name, text in kernels(args.against).items()} if args.against else {}
    found = 0
    for name, text in kernels(args.object).items():
        found += 1
        ops = loop_opcodes(text)
        if ops is None:
            print(f"{name}\n  no loop around a wgmma")
            continue
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(args.top))
        print(f"{name}\n  main loop: {len(ops)} instructions ({top})")
        if args.against:
            theirs = other.get(name.split("(")[0])
            their_ops = loop_opcodes(theirs) if theirs else None
            if their_ops is None:
                print("  against: no such kernel with a loop there")
                continue
            delta = collections.Counter(ops)
            delta.subtract(their_ops)
            print(f"  against: {len(their_ops)} instructions there, order likeness {order_likeness(ops, their_ops):.3f}"
                  f", counts here minus there {dict(sorted((op, n) for op, n in delta.items() if n))}")
    if not found:
        sys.exit("sass_loops.py: no kernel matches " + " and ".join(repr(s) for s in args.names))


if __name__ == "__main__":
    main()
