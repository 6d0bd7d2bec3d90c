#!/usr/bin/env bash
# One run on the GPU machine: build nbhd with nvcc for sm_90a, run the CUDA test suite,
# compute-sanitizer (memcheck, racecheck) on a small sweep, then the benchmark.
# Logs go to $OUT (or ./out); the summary table prints last.
#   STAGES="build test sanitize bench" (the default; "ab" adds the A/B of the listed tile
#   configurations of the forward and forward+JVP, bench/ab_gpu.py; "ab_ref" the A/B against
#   the library of another source tree, AB_REF=<dir>, AB_BENCH_ARGS="..." for its bench)
#   "cp" runs bench/bench_context_parallel.py under torchrun on each of CP_WORLDS="2 4" GPUs
#   (CP_ARGS="...", e.g. "--axes 2,0+2 --reps 2"); "autodiff" runs bench/bench_autodiff.py
#   --device cuda (first- and second-order autodiff; AUTODIFF_ARGS="..."); "rpb" bench/bench_rpb.py
#   on the GPU problems: each op alone, then the forward through nbhd.compat (RPB_ARGS="...")
#   BENCH_ARGS="..."  PYTEST_ARGS="..."  AB_ARGS="..."  AB_KINDS="fwd jvp" (which A/Bs: fwd, jvp, bwd)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test sanitize bench"}
export PYTHONUNBUFFERED=1 NBHD_CUDA_ARCH=${NBHD_CUDA_ARCH:-90a}
PY=${PY:-python3}
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"

# ab_ref: outputs (bitwise, bench/ab_outputs.py) and speed (bench/bench_gpu.py, back to back) of
# this tree's library against one built from the source tree $AB_REF (e.g. a `git worktree` of
# the commit before a change), built alongside this tree's
if has ab_ref; then
    (cd "$AB_REF" && NBHD_CUDA=1 $PY setup.py -q build_ext --inplace --force >"$OUT/ab_ref_build.log" 2>&1) &
    ab_ref_build=$!
fi

if has build; then
    t0=$SECONDS
    if $PY -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
        summary+=("build: ok ($((SECONDS - t0)) s)")
        # the Hopper forward must run on wgmma (HGMMA in its SASS), not on HMMA
        obj=$(ls nbhd/_nbhd*.so 2>/dev/null | head -1)
        if [ -n "$obj" ] && command -v cuobjdump >/dev/null; then
            summary+=("library SASS: $(cuobjdump -sass "$obj" | grep -c HGMMA) HGMMA (fna_wgmma.cu), $(cuobjdump -sass "$obj" | grep -c 'HMMA') HMMA")
        fi
    else
        tail -40 "$OUT/build.log"; summary+=("build: FAILED (see build.log)")
        printf '%s\n' "${summary[@]}"; exit 1
    fi
fi

if has ab_ref; then
    wait $ab_ref_build
    ref=$(ls "$AB_REF"/nbhd/_nbhd*.so 2>/dev/null | head -1)
    new=$(ls nbhd/_nbhd*.so 2>/dev/null | head -1)
    for dev in cuda cpu; do
        $PY bench/ab_outputs.py "$ref" "$new" --device $dev >"$OUT/ab_outputs_$dev.log" 2>&1
        summary+=("ab_outputs $dev (reference $AB_REF): rc=$?, $(tail -1 "$OUT/ab_outputs_$dev.log")")
    done
    for lib in "$ref" "$new" "$ref" "$new"; do
        echo "== NBHD_LIBRARY=$lib" >>"$OUT/ab_speed.log"
        NBHD_LIBRARY=$lib $PY bench/bench_gpu.py ${AB_BENCH_ARGS:-} >>"$OUT/ab_speed.log" 2>&1
    done
    summary+=("speed A/B (reference, this tree, twice): ab_speed.log")
fi

if has test; then
    t0=$SECONDS
    eval "set -- ${PYTEST_ARGS:-}"  # quoted arguments, e.g. PYTEST_ARGS="-k 'backward or tiles'"
    $PY -m pytest -q -x --timeout=900 -p no:cacheprovider tests/test_cuda.py tests/test_attention_merge.py::test_merge_kernel_cuda "$@" \
        >"$OUT/test.log" 2>&1
    rc=$?
    tail -25 "$OUT/test.log"
    summary+=("tests/test_cuda.py + merge kernel: rc=$rc, $(grep -E '[0-9]+ (passed|failed)' "$OUT/test.log" | tail -1) ($((SECONDS - t0)) s)")
fi

if has sanitize; then
    for tool in memcheck racecheck initcheck; do
        t0=$SECONDS
        compute-sanitizer --tool $tool --error-exitcode 9 $PY scripts/sanitize_cuda.py \
            >"$OUT/sanitize_$tool.log" 2>&1
        rc=$?
        tail -5 "$OUT/sanitize_$tool.log"
        summary+=("compute-sanitizer $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|INITCHECK' "$OUT/sanitize_$tool.log" | tail -1) ($((SECONDS - t0)) s)")
    done
fi

if has ab; then
    ab_kind() { [[ " ${AB_KINDS:-fwd jvp} " == *" $1 "* ]]; }
    if ab_kind fwd; then
        $PY bench/ab_gpu.py ${AB_ARGS:-} 2>&1 | tee "$OUT/ab.log"
    fi
    if ab_kind jvp; then
        $PY bench/ab_gpu.py --jvp ${AB_ARGS:-} 2>&1 | tee "$OUT/ab_jvp.log"
    fi
    if ab_kind bwd; then
        $PY bench/ab_gpu.py --bwd ${AB_ARGS:-} 2>&1 | tee "$OUT/ab_bwd.log"
    fi
fi

if has cp; then
    for world in ${CP_WORLDS:-2 4}; do
        [ "$(nvidia-smi -L | wc -l)" -ge "$world" ] || { summary+=("cp on $world GPUs: skipped (fewer GPUs)"); continue; }
        PYTHONPATH=bench $PY -m torch.distributed.run --nproc_per_node "$world" bench/bench_context_parallel.py \
            ${CP_ARGS:-} --csv "$OUT/cp_$world.csv" >"$OUT/cp_$world.log" 2>&1
        summary+=("cp on $world GPUs: rc=$? (cp_$world.log, cp_$world.csv)")
    done
fi

if has bench; then
    $PY bench/bench_gpu.py --csv "$OUT/bench.csv" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi

if has rpb; then
    # the kernel ops alone, then the forward through the module (and the folded route: slow)
    rpb_bench() {
        $PY bench/bench_rpb.py --device cuda --dtype bf16 --problems h-2d-64,h-2d-128,h-3d-16 --rounds 7 \
            ${RPB_ARGS:-} "$@" 2>&1 | tee -a "$OUT/rpb.log"
    }
    rpb_bench --op --calls 20 --rounds 9
    rpb_bench --op --bwd --calls 20 --rounds 9
    rpb_bench --op --jvp-bwd --rounds 3
    rpb_bench --runs "no rpb,in-kernel,fold"
    rpb_bench --runs "no rpb,in-kernel" --calls 20
    summary+=("rpb bench: rpb.log")
fi

if has autodiff; then
    $PY bench/bench_autodiff.py --device cuda --csv "$OUT/autodiff.csv" ${AUTODIFF_ARGS:-} 2>&1 | tee "$OUT/autodiff.log"
    summary+=("autodiff bench: rc=${PIPESTATUS[0]} (autodiff.log, autodiff.csv)")
fi

echo "==== summary ($(cat "$OUT/device.txt"))"
printf '%s\n' "${summary[@]}"
has bench && grep -v "^  flex failed" "$OUT/bench.log" | tail -12
