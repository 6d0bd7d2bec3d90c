#!/usr/bin/env bash
# Development run on the GPU machine: build, the CUDA tests, and the A/B of the forward and
# forward+JVP variants (bench/ab_fwd.py). AB_ARGS passes options to both A/B runs.
set -u
OUT=${OUT:-out}
export NBHD_CUDA_ARCH=90a PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
python3 -m pip install -q --no-build-isolation --no-deps -e . >$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $((SECONDS-t0)) s"
t0=$SECONDS
python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -2
NBHD_MMA_FWD_MB=2 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k test_forward 2>&1 | tail -1
echo "tests $((SECONDS-t0)) s"
python3 bench/ab_fwd.py --rounds 3 ${AB_ARGS:-} 2>&1 | tee $OUT/ab.log
[ -n "${AB_JVP:-}" ] && python3 bench/ab_fwd.py --rounds 3 --jvp ${AB_ARGS:-} 2>&1 | tee $OUT/ab_jvp.log
exit 0
