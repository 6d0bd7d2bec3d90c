#!/usr/bin/env bash
# Nsight Compute summaries of the tensor-core kernels (run on the GPU machine after a build):
# duration, occupancy, issue rate, tensor-pipe use and warp stall reasons per kernel, for the
# second of two forward+backward calls; text reports under $OUT.
#   PROBLEMS="2d7 3d7" SOURCE="2d13" [SKIP=3 COUNT=3: launches skipped, profiled]
#   [KERNELS=fna_wgmma_tma: the kernels' name pattern] bash scripts/profile_gpu.sh
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PY:-python3}
STALLS=barrier,long_scoreboard,short_scoreboard,wait,math_pipe_throttle,mio_throttle,not_selected,selected,lg_throttle,dispatch_stall,no_instruction,branch_resolving
METRICS=gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_per_inst_issued.ratio,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
for s in ${STALLS//,/ }; do METRICS+=",smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"; done
for p in ${PROBLEMS:-2d7 2d7-64}; do
    ncu --clock-control none --launch-skip ${SKIP:-3} --launch-count ${COUNT:-3} -k regex:"${KERNELS:-fna_|dq_convert}" \
        --metrics "$METRICS" $PY scripts/profile_gpu.py "$p" >"$OUT/ncu_$p.txt" 2>&1
    echo "== $p (rc=$?)"
    grep -E "fna_|dq_convert|gpu__time|registers|warps_active|inst_executed|issue_active|hmma|latency_per|stalled|dram__|lts__|pipe_" \
        "$OUT/ncu_$p.txt" | sed -e 's/  */ /g' -e 's/smsp__average_warps_issue_stalled_//' | cut -c1-150
done
# SOURCE="2d13": the forward's instruction mix and its source lines by warp stall (SourceCounters)
for p in ${SOURCE:-}; do
    ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:'fna_.*forward' --import-source yes \
        --section SourceCounters --section InstructionStats --section WarpStateStats $PY scripts/profile_gpu.py "$p" \
        >"$OUT/ncu_source_$p.txt" 2>&1
    echo "== source $p (rc=$?): ncu_source_$p.txt"
done
