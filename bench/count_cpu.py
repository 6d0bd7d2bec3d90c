"""Instructions per function of a callgrind profile of bench/count_cpu.c (see there), inlined code
summed into the function that holds it, with the share of the total.

    python bench/count_cpu.py cg.out [FLOP] [lanes]

With FLOP (useful work, as count_cpu prints) and the vector lanes (8 under valgrind: AVX2) it
also prints the instructions per useful vector FMA (FLOP / 2 / lanes of them at the least).
"""
import collections
import re
import subprocess
import sys

text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--auto=no", "--threshold=100",
                       sys.argv[1]], capture_output=True, text=True, check=True).stdout
per_function = collections.Counter()
total = 0
in_table = False   # the per-function table follows its "file:function" header
for line in text.splitlines():
    if line.rstrip().endswith("file:function"):
        in_table = True
        continue
    m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)", line)
    if not m:
        continue
    count, where = int(m.group(1).replace(",", "")), m.group(2)
    if "PROGRAM TOTALS" in where:
        total = count
        continue
    if not in_table:
        continue
    name = where.split(":", 1)[1] if ":" in where else where
    per_function[name.split(" [")[0]] += count
print(f"{total:>14,d}  total")
for name, count in per_function.most_common(12):
    print(f"{count:>14,d}  {100 * count / total:5.1f} %  {name}")
if len(sys.argv) > 2:
    fmas = float(sys.argv[2]) / 2 / int(sys.argv[3] if len(sys.argv) > 3 else 8)
    print(f"useful vector FMAs {fmas:,.0f}: {total / fmas:.2f} instructions per useful FMA")
