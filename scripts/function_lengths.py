"""Lengths of the C functions in the given files or folders (.c, .h, .cu, .cuh, recursively),
longest first.

    python scripts/function_lengths.py csrc/cpu --max 120 [--top 10] [--exclude 'csrc/cpu/amx/*']

A function runs from the first line of its signature to its closing brace. Prints the `top`
longest and every one over `max`; exit status 1 when any is over `max`.
"""
import argparse
import fnmatch
import os
import re
import sys

SUFFIXES = (".c", ".h", ".cu", ".cuh")


def strip(text: str) -> str:
    """text with comments, string and character literals and preprocessor lines blanked (newlines kept)"""
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(\\.|[^'\\\n])*'", "''", text)
    lines = text.split("\n")
    out, continued = [], False
    for line in lines:   # a directive continues while its line ends in a backslash
        directive = continued or line.lstrip().startswith("#")
        continued = directive and line.rstrip().endswith("\\")
        out.append("" if directive else line)
    return "\n".join(out)


def signature_name(head: str):
    """The function name when head (the text before a file-scope brace) ends in a parameter
    list: `name(...)` or a name macro `FAST(name)(...)`; else None (a struct, an initializer)."""
    head = re.sub(r"__attribute__\s*\(\(.*?\)\)\s*$", "", head.rstrip(), flags=re.S).rstrip()
    if not head.endswith(")") or re.search(r"=\s*$", head):
        return None
    depth, i = 0, len(head) - 1
    while i >= 0:   # back to the parameter list's opening parenthesis
        depth += {")": 1, "(": -1}.get(head[i], 0)
        if depth == 0:
            break
        i -= 1
    m = re.search(r"([A-Za-z_]\w*\s*\(\s*\w+\s*\)|[A-Za-z_]\w*)\s*$", head[:max(i, 0)])
    return re.sub(r"\s+", "", m.group(1)) if m else None


def functions(path: str):
    """(name, first line, line count) of each function defined at file scope"""
    text = strip(open(path, encoding="utf-8", errors="replace").read())
    depth, head_from, start, name, found = 0, 0, 0, None, []
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                head = text[head_from:i]
                name = signature_name(head)
                start = head_from + (len(head) - len(head.lstrip()))
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                if name:
                    first = text.count("\n", 0, start) + 1
                    found.append((name, first, text.count("\n", 0, i) + 2 - first))
                name = None
                head_from = i + 1
        elif ch == ";" and depth == 0:
            head_from = i + 1
    return found


def sources(paths, exclude):
    for p in paths:
        files = [p] if os.path.isfile(p) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if f.endswith(SUFFIXES))
        for f in files:
            if not any(fnmatch.fnmatch(f, pat) for pat in exclude):
                yield f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--max", type=int, default=120, help="longest allowed function, in lines")
    ap.add_argument("--top", type=int, default=10, help="how many of the longest to print")
    ap.add_argument("--exclude", action="append", default=[], help="glob of paths to skip (repeatable)")
    args = ap.parse_args()
    rows = sorted(((n, path, line, name) for path in sources(args.paths, args.exclude)
                   for name, line, n in functions(path)), reverse=True)
    over = [r for r in rows if r[0] > args.max]
    for n, path, line, name in rows[:max(args.top, len(over))]:
        print(f"{n:5d}  {path}:{line}  {name}{'  (over ' + str(args.max) + ')' if n > args.max else ''}")
    print(f"{len(rows)} functions, {len(over)} over {args.max} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
