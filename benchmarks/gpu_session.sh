#!/usr/bin/env bash
# One device-machine call that runs every GPU check and benchmark of the repo, stage by stage, each
# under its own time limit, logs in $OUT (set by the device tool; defaults to ./gpu_logs).
#   bash benchmarks/gpu_session.sh [stage ...]     stages: tests m3_tests m3_bench m3_profile adamw_tests adamw
#                                                  e2e1 e2e3 e2e1_old e2e3_old remat1 noguard1 soak decode dp2
#                                                  anchors_build side_ops side_train side_long e2e1_prof e2e3p e2e1_long
#                                                  mixer_bench scan_sweep e2e1_dump e2e3_dump (profile + optimized HLO; M3_PROF_CFG=K=V,... a scan config; PROF_TREE=1 the plain-tree TrainState (flat is the default))
#                                                  conv_bench tests_m1 scan_parallel e2e3_prof gpu_auto
#                                                  e2e1_nocb e2e1_cb (command buffers off / widened, XLA_FLAGS)
#                                                  mosaic_fwd (the Mosaic GPU scan prototypes: GPU tests, forward
#                                                  timing, the op's sweep; mosaic_tests / mosaic_bench: the
#                                                  first two alone) e2e1_mosaic (the train step with both)
#                                                  seq_bench (the sequence-sharded scans' per-device overhead)
#                                                  multi_equal scaling (issue 18, a multi-GPU kind: gradients vs one
#                                                  device, DP / FSDP / sequence-parallel scaling; split scaling into
#                                                  several calls with bench_scaling.py --modes/--models/--devices)
#                                                  side_train3 side_train1 (the PyTorch train anchor, one model each;
#                                                  side_train3 needs only the selective-scan extension)
#                                                  anchors_ss side_ops3 (only the selective-scan extension; the
#                                                  Mamba-3 op side by side at the three op shapes of docs/performance.md)
#                                                  m3_stored e2e3_stored (the stored-scores / ungated-Y variants:
#                                                  op sweep at b8t2048 and b32t512, train step with profile;
#                                                  e2e3_keys: the train step with stored_for_keys too)
#                                                  m3_qk (the query/key kernels' knobs: op sweep at both shapes)
#                                                  m3_head m3_head_bench (the rotation in the chunk-gradient launch vs the
#                                                  query/key gradient kernel: profiles, op sweep)
#                                                  m3_skip e2e3_skip (the skip term as the scores' diagonal, the default, vs the per-position weight: profiles,
#                                                  its GPU tests, train step with the weight; m3_skip8: profiles at b8t2048 with and without), e2e3_gc (train step with / without gc.freeze; e2e1_gc: Mamba-1 with)
#                                                  m3_adt e2e3_adt (dADT in the values vs keys launch, keys+queries in one launch: op sweep, train step)
#                                                  dispatch (a synchronised op call split: dispatch, wait, pipelined, trivial-jit floor; with and without command buffers)
#                                                  m3_prof32 (the op's per-kernel profile at B=32 T=512)
#                                                  e2e1_stride (the Mamba-1 train step with and without bwd_adjoint_stride=2)
#                                                  m3_fastrot e2e3_fastrot (Mamba3ScanConfig.fast_rotation: its GPU tests,
#                                                  profiles at both op shapes with and without, the train step with and without)
#                                                  m3_ncu (Nsight Compute on the op's 10 Pallas kernels, NCU_SHAPE=b32t512)
#                                                  dispatch32 (bench_dispatch.py, Mamba-3 at B=32 T=512; dispatch32h: per-head
#                                                  angles as the anchors' op timing, alone and in the anchors' process
#                                                  conditions) m3_prof32h (the profile with per-head angles; m3_dump32h:
#                                                  the same with the optimized HLO of the op's fwd+bwd packed)
#                                                  m3_qk16 m3_prof16 e2e3_qk16 (dq, dk̃ in bf16, the default, vs float32:
#                                                  op sweep, per-kernel profiles of the op, train step with profile)
# e2e1x / e2e3x: the train step for each config of E2E1_CFGS / E2E3_CFGS ("default" or K=V,...; default: default;
# suffixes, e.g. default+keep+fastconv: "+keep" adds --mixer-residuals activations, "+fastconv" the conv
# kernels' fast_math and fused_multiply_add (both the defaults since 2026-12-06); "+recompute" and "+exactconv"
# turn them off; "+loopconv" the conv kernels' loop over positions, ConvBlockConfig.loop_rows). conv_bench: bench_causal_conv.py's sweep (incl. fast + fma).
# m3_profx: the Mamba-3 op's per-kernel profile (per-head angles) for each of M3_CFGS at each of M3_SHAPES.
# defaults_ab: the train steps with the defaults of 2026-12-06 against the ones before (Mamba-1: stride 1,
# recomputed activations, exact conv math; Mamba-3: libdevice rotation) and with the conv kernels' loop_rows.
# norm_tests / norm_bench / norm_ab: the add + RMSNorm kernels (jmamba.ops.add_rms_norm): their GPU tests,
# bench_rms_norm.py's sweep, the train steps of both models with the kernels (default) and with the XLA
# composition ("+xlanorm" suffix: --prefer add_rms_norm=xla).
# qkt_tests: the GPU tests of Mamba3ScanConfig.qk_gradients_transposed (session 37) and of fast_math (checked against
# the default config's own error) and of transposed_gradient_dots; time them in the train step (shared angles: the
# position-major kernel's default case) with E2E3_CFGS="default transposed_gradient_dots=True" e2e3x (m3_profx
# profiles per-head angles, where the row-major kernel is the default).
# angle_pass: the GPU tests of Mamba3ScanConfig.angle_gradient_pass and stored_theta / position_major_d_angles
# (session 38), then the op's profile at both shapes (per-head angles) with and without the angle pass.
# kq_tests: the GPU tests of Mamba3ScanConfig.keys_with_queries (with state_dot_with_keys, session 34) and of
# bias_gradients_by_xla (session 35); time them with M3_CFGS="default keys_with_queries=True ..." m3_profx and
# E2E3_CFGS=keys_with_queries=True e2e3x.
# norm2_tests: the one-launch sum-of-squares kernel's GPU test (jmamba.ops.sum_of_squares, the global norm); the
# "+pallasnorm" suffix of e2e1x / e2e3x runs the train step with it (--prefer sum_of_squares=pallas; the automatic
# choice on one GPU since session 34), "+xlanormsq" with the per-leaf XLA sums instead.
# lse_tests / lse_ab: the one-pass log-sum-exp kernel (jmamba.ops.log_sum_exp): its GPU tests, the train steps
# with the kernel ("+pallaslse": --prefer log_sum_exp=pallas) and without (the default until then).
# dx_bench / dx_ab2 (session 41): split_dense's backward alone (bench_split_dense.py, optimized HLO packed) and the
# Mamba-3 train step with `xla_gpu_triton_gemm_any=false` ("+notritongemm" suffix: XLA_FLAGS), without and with
# the "xla" dx summed right to left (the order in which the GEMM rewriter folds both sums into the matmuls).
# dx_ab: the Mamba-3 train step with split_dense's default ("reference": JAX's transpose of the barrier) and with
# its custom VJP ("+sumdx": dx summed with no barrier; slower on an H100, session 30).
# qk_tests / qk_ab: the B/C norms fused with the Mamba-3 kernel layout (pallas_kernels/mamba3_siso/qk_norm.py): its
# GPU tests; the train step without it (default until timed) and with it (fuse_qk_norm=True). s29_tests: the GPU
# tests of session 29's kernels (the Mamba-3 projection and qk_norm kernels, and the log-sum-exp kernel of session
# 28). s29_ab: the Mamba-3 train step as the defaults stand, with the projection kernels (fuse_projection=True),
# with the qk_norm kernels alone (fuse_qk_norm=True), and with split_dense's summed dx (+sumdx; session 30 ran it
# with +barrierdx, then the other choice, now the default).
# proj_bench: bench_mamba3_projection.py, the op alone (XLA ops / qk_norm kernels / projection kernels, the last
# with 1, 2 and 4 programs per chunk). proj_tests: the projection kernels' GPU tests. proj_ab: the Mamba-3 train
# step as the defaults stand (since session 31: the projection kernels at 2 programs per chunk), with the XLA
# per-position ops instead (fuse_projection=False), and with 1 and 4 programs per chunk (notes_mamba3_scan.md v20).
# m1_keep_tests: the mixer core's kept-activation tests (mixer_residuals="activations") with the real kernels.
# tests: every -m gpu test (~82, ~7 min on an H100: more than one call's other stages leave room for);
# tests_m3 / tests_rest split it into the Mamba-3 + mixer-core files (~4 min) and everything else (~4 min);
# tests_m3only: the Mamba-3 scan file alone (M3_TESTS_LIMIT seconds, default 300; 49 cases, ~230 s with warm
# caches, more on a fresh machine). tests_m3part: part M3_PART of M3_PARTS (default 1 of 2) of those cases, in
# collection order (the case list logged beside), so the matrix fits two calls.
# new_tests: the GPU tests of fast_rotation, the hardware cos/sin and bwd_adjoint_stride in one pytest process.
# m1_prefetch: the Mamba-1 backward rows loaded a sub-chunk ahead, the default since 2026-12-04 (its GPU
# test, op sweep, the train step without it; e2e1_pf: that train step alone, log tagged by PF_TAG, for an
# A/B/A with e2e1_gc).
# side_ops1: the Mamba-1 op side by side only (the official CUDA scan; needs only the selective-scan extension).
# m1_prof: the Mamba-1 op's per-kernel profile (fwd+bwd) for each config of M1_CFGS (space-separated
# "default" or K=V,... lists; default: "default bwd_adjoint_stride=2") at M1_SHAPE (b8t2048).
# m3_walk / e2e3_walk: the walking state passes, the default (profiles at both op shapes vs split and 32 rows,
# GPU tests; e2e3_walk: the train step with the split passes). e2e3g: the train step with the defaults, gc frozen.
# probe_anchor: our op timed inside the anchors' op process right after their timing (split, trace, gaps;
# run anchors_ss earlier in the call, carry .anchors).
# host_dispatch: bench_host_dispatch.py for both models (the TrainState's jit-boundary host cost as it is,
# as nnx trees, and packed into one buffer per dtype: notes_training_step.md session 31).
# probe_train / probe_ops: benchmarks/probe_anchor_torch.py, the PyTorch train anchor (PROBE_MODELS, default Mamba3;
# Mamba1 needs anchors_build's second extension too) with its host issue time, kernel sum and GPU busy time
# per step, and the host's CPU model (is the anchor bound by the host?); PROBE_LIMIT seconds (default 300; the
# official Mamba-3 Triton kernels compile for minutes on a fresh machine without a carried Triton cache).
# pack_logs: every log in $OUT into logs.tgz (the device tool returns at most 8 files).
# cache_restore / cache_save: the Triton (official kernels) and JAX compilation caches, unpacked from
# .devcache/*.tgz (git-ignored; carry .devcache) / packed into $OUT (copy them to .devcache for the next call).
# anchors_* / side_*: the official kernels and PyTorch model (the anchors folder copied to .anchors, carried):
# anchors_build starts their CUDA build in the background (~7 min), side_* wait for it.
#                                                  (default: the list in `stages=` below)
# e2e*_old time the tree of an earlier commit unpacked in .old/ (git archive REV | tar -x -C .old; carry
# .old), for a before/after ratio in one call; m3_prof32h_old: the per-head-angle profile of that tree.
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTHONWARNINGS=ignore::DeprecationWarning
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export TRITON_CACHE_DIR=/tmp/tc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages=${*:-tests adamw_tests e2e1 e2e3 m3_profile adamw dp2 m3_bench}
wait_anchors() {  # both official CUDA extensions built (at most 9 min after anchors_build)
  local t=0
  if [ ! -f .anchors/build.py ] || ! pgrep -f ".anchors/build.py" > /dev/null && ! ls /tmp/ab/ss/selective_scan_cuda*.so > /dev/null 2>&1; then
    echo "anchors: no build running or done on this machine (run anchors_build in this call, carry .anchors)"; return 1
  fi
  until ls /tmp/ab/ss/selective_scan_cuda*.so /tmp/ab/cc/causal_conv1d_cuda*.so > /dev/null 2>&1; do
    sleep 5; t=$((t + 5)); if [ $t -ge 540 ]; then echo "anchors not built"; tail -5 "$OUT/anchors_build.log"; return 1; fi
  done
}
wait_ss() {  # the official selective-scan extension built (enough for the Mamba-3 PyTorch anchor)
  local t=0
  until ls /tmp/ab/ss/selective_scan_cuda*.so > /dev/null 2>&1; do
    sleep 5; t=$((t + 5)); if [ $t -ge 300 ]; then echo "selective_scan extension not built"; return 1; fi
  done
}
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) ==="
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "--- $name rc=$rc in $(( $(date +%s) - t0 ))s"; tail -n 14 "$OUT/$name.log"
  return $rc
}
pack_hlo() {  # dump dir, out file: the largest optimized module (the train step), gzipped
  local f; f=$(ls -S "$1"/*after_optimizations.txt 2>/dev/null | head -1)
  [ -n "$f" ] && gzip -c "$f" > "$2" && echo "packed $f -> $2"
}
train_steps() {  # arch, configs ("default" or K=V,..., each with optional +keep / +fastconv suffixes): the train
  local arch=$1 cfg tag extra prefer; shift   # step for each, logs e2e_<arch>_<config>. Mamba-1 only: "+keep" adds
  for cfg in "$@"; do tag=$(echo "$cfg" | tr '=,+' '___'); extra=""   # --mixer-residuals activations, "+fastconv"
    case $cfg in *+keep*) extra="$extra --mixer-residuals activations" ;; esac   # the conv kernels' fast math + fma
    case $cfg in *+fastconv*) extra="$extra --conv-config fast_math=True,fused_multiply_add=True" ;; esac
    case $cfg in *+recompute*) extra="$extra --mixer-residuals inputs" ;; esac     # the defaults before 2026-12-06
    case $cfg in *+exactconv*) extra="$extra --conv-config fast_math=False,fused_multiply_add=False" ;; esac
    case $cfg in *+loopconv*) extra="$extra --conv-config loop_rows=True" ;; esac
    case $cfg in *+flat*) extra="$extra --flat" ;; esac          # TrainState.create(..., flat=True) (the bench's
    case $cfg in *+tree*) extra="$extra --no-flat" ;; esac       # one-device default since session 33; +tree: the plain tree)
    case $cfg in *+norm4x2*) extra="$extra --norm-config block_rows=4,num_warps=2" ;; esac   # add + RMSNorm launch
    prefer=""
    case $cfg in *+xlanorm*) prefer="$prefer,add_rms_norm=xla" ;; esac
    case $cfg in *+pallaslse*) prefer="$prefer,log_sum_exp=pallas" ;; esac
    case $cfg in *+barrierdx*) prefer="$prefer,split_dense=reference" ;; esac
    case $cfg in *+sumdx*) prefer="$prefer,split_dense=xla" ;; esac            # dx summed right to left (since s41)
    case $cfg in *+pallasnorm*) prefer="$prefer,sum_of_squares=pallas" ;; esac   # the global norm in one launch (automatic since s34)
    case $cfg in *+xlanormsq*) prefer="$prefer,sum_of_squares=xla" ;; esac       # the global norm as per-leaf XLA sums
    case $cfg in *+pallasrows*) prefer="$prefer,finite_rows=pallas" ;; esac      # the guard's state check in one launch (opt-in)
    [ -n "$prefer" ] && extra="$extra --prefer ${prefer#,}"
    xflags=""   # "+notritongemm": plain dots stay cuBLAS calls, so the GEMM rewriter can fold adds into them
    case $cfg in *+notritongemm*) xflags="--xla_gpu_triton_gemm_any=false" ;; esac
    cfg=${cfg%%+*}; [ "$cfg" = default ] && cfg=""
    XLA_FLAGS="${XLA_FLAGS:-}${xflags:+ $xflags}" run e2e_${arch}_$tag 130 python3 benchmarks/bench_train_step.py --arch $arch --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze $extra ${cfg:+--scan-config $cfg} ; done
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1; cat "$OUT/gpu.txt"
OPT=fused
for s in $stages; do case $s in
  tests)       run gpu_tests 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rA ;;
  tests_m3)    run gpu_tests_m3_and_mixer 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py tests/test_mamba1_mixer_core.py -rA ;;
  tests_m3only) run gpu_tests_m3 ${M3_TESTS_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -rA --durations=10 ;;
  tests_m3part) mapfile -t ids < <(python3 -m pytest --collect-only -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py 2>/dev/null | grep '::')
               k=${M3_PART:-1}; of=${M3_PARTS:-2}; n=${#ids[@]}; lo=$(( (k - 1) * n / of )); hi=$(( k * n / of ))
               echo "tests_m3part: cases $((lo + 1))-$hi of $n" > "$OUT/gpu_tests_m3_part${k}of${of}_ids.log"; printf '%s\n' "${ids[@]:lo:hi-lo}" >> "$OUT/gpu_tests_m3_part${k}of${of}_ids.log"
               run gpu_tests_m3_part${k}of${of} ${M3_TESTS_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -rA --durations=10 "${ids[@]:lo:hi-lo}" ;;
  tests_rest)  run gpu_tests_rest 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rA --ignore=tests/test_mamba3_scan_pallas.py --ignore=tests/test_mamba1_mixer_core.py ;;
  cache_restore) for c in tc jcc; do [ -f .devcache/$c.tgz ] && mkdir -p /tmp/$c && tar xzf .devcache/$c.tgz -C /tmp/$c && echo "restored $c: $(du -sh /tmp/$c | cut -f1)"; done ;;
  cache_save)  for c in tc jcc; do [ -d /tmp/$c ] && tar czf "$OUT/$c.tgz" -C /tmp/$c . && ls -la "$OUT/$c.tgz"; done ;;
  m3_ncu)      run m3_ncu_${NCU_SHAPE:-b32t512} 240 ncu --clock-control none --kernel-name regex:mamba3_siso --launch-skip 10 --launch-count 10 \
                 --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
                 --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
                 python3 benchmarks/bench_dispatch.py --arch mamba3 --shape ${NCU_SHAPE:-b32t512} --iters 2 ${NCU_ARGS:-} ;;
  dispatch32)  run dispatch_b32t512 120 python3 benchmarks/bench_dispatch.py --arch mamba3 --shape b32t512 ;;
  dispatch32h) run dispatch_b32t512_per_head_angles 120 python3 benchmarks/bench_dispatch.py --arch mamba3 --shape b32t512 --per-head-angles ;
               XLA_PYTHON_CLIENT_PREALLOCATE=false run dispatch_b32t512_per_head_angles_torch 120 python3 benchmarks/bench_dispatch.py --arch mamba3 --shape b32t512 --per-head-angles --torch ;;
  m3_prof32h)  run m3_profile_b32t512_per_head_angles 60 python3 benchmarks/profile_kernels.py mamba3 --shape b32t512 --iters 10 --per-head-angles ;;
  m3_dump32h)  XLA_FLAGS="--xla_dump_to=/tmp/hlo_op --xla_dump_hlo_as_text" run m3_profile_b32t512_per_head_angles_dump 90 python3 benchmarks/profile_kernels.py mamba3 --shape b32t512 --iters 5 --per-head-angles ;
               f=$(grep -l "mamba3_siso_bwd_query_key_gradients" /tmp/hlo_op/*after_optimizations.txt 2>/dev/null | head -1); [ -n "$f" ] && gzip -c "$f" > "$OUT/hlo_op_b32t512.txt.gz" && echo "packed $f"
               m=$(basename "${f:-none}" | cut -d. -f1-2); ls -la /tmp/hlo_op | grep -F "$m" | head -30   # the module's other dumps (thunk sequence, buffer assignment)
               [ -n "$f" ] && (cd /tmp/hlo_op && find . -name "$m*" -size -8M \( -name "*thunk*" -o -name "*buffer*" -o -name "*memory*" \) | tar czf "$OUT/hlo_op_extra.tgz" -T -) ;;
  m3_prof32h_old) PYTHONPATH=$PWD/.old run m3_profile_b32t512_per_head_angles_old 60 python3 .old/benchmarks/profile_kernels.py mamba3 --shape b32t512 --iters 10 --per-head-angles ;;
  m3_head)     for cfg in "" rotate_in_chunk_gradients=True rotate_in_chunk_gradients=True,num_warps_head_grad=8 rotate_in_chunk_gradients=True,head_gradient_launches=1,num_warps_head_grad=8; do
                 tag=$(echo "${cfg:-default}" | tr '=,' '__')
                 run m3_profile_b32t512_per_head_angles_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape b32t512 --iters 10 --per-head-angles ${cfg:+--scan-config $cfg} ; done ;
               for cfg in "" rotate_in_chunk_gradients=True; do
                 tag=$(echo "${cfg:-default}" | tr '=,' '__')
                 run m3_profile_b8t2048_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape b8t2048 --iters 10 ${cfg:+--scan-config $cfg} ; done ;;
  m3_skip)     for sh in b32t512 b8t2048; do for cfg in "" skip_in_scores=False; do tag=$(echo "${cfg:-default}" | tr '=,' '__')
                 run m3_profile_${sh}_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape $sh --iters 10 ${cfg:+--scan-config $cfg} ; done ; done ;
               for cfg in "" skip_in_scores=False; do tag=$(echo "${cfg:-default}" | tr '=,' '__')
                 run m3_profile_b32t512_per_head_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape b32t512 --per-head-angles --iters 10 ${cfg:+--scan-config $cfg} ; done ;
               run m3_skip_gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -k "skip or rotation" -rA ;;
  m3_skip8)    for cfg in skip_in_scores=True skip_in_scores=False; do tag=$(echo "$cfg" | tr '=,' '__')
                 run m3_profile_b8t2048_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape b8t2048 --iters 10 --scan-config $cfg ; done ;;
  m3_walk)     for sh in b32t512 b8t2048; do for cfg in state_passes=split state_passes=walk state_passes=walk,walk_block_p=32; do
                 tag=$(echo "$cfg" | tr '=,' '__'); run m3_profile_${sh}_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape $sh --iters 10 --per-head-angles --scan-config $cfg ; done ; done ;
               run m3_walk_gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -k walking -rA ;;
  e2e3_walk)   run e2e_mamba3_split_passes 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze --scan-config state_passes=split ;;
  probe_train) wait_ss && { lscpu | grep -E "Model name|^CPU\(s\)|MHz" > "$OUT/host_cpu.txt"; cat "$OUT/host_cpu.txt"; } && run probe_anchor_train ${PROBE_LIMIT:-300} python3 benchmarks/probe_anchor_torch.py .anchors /tmp/ab train --models ${PROBE_MODELS:-Mamba3} ;;
  probe_ops)   wait_ss && run probe_anchor_ops 240 python3 benchmarks/probe_anchor_torch.py .anchors /tmp/ab ops ;;
  probe_anchor) wait_ss && XLA_PYTHON_CLIENT_PREALLOCATE=false run probe_anchor_op 330 python3 benchmarks/probe_anchor_op.py .anchors /tmp/ab ;;
  pack_logs)   (cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log) ;;
  e2e3_skip)   run e2e_mamba3_skip_as_weight 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze --scan-config skip_in_scores=False ;;
  m3_fastrot)  run m3_fastrot_gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_inline_ptx.py tests/test_mamba3_scan_pallas.py -k "fast_rotation or hardware" -rA ;
               for cfg in "" fast_rotation=True; do tag=$(echo "${cfg:-default}" | tr '=,' '__')
                 run m3_profile_b8t2048_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape b8t2048 --iters 10 ${cfg:+--scan-config $cfg} ;
                 run m3_profile_b32t512_per_head_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape b32t512 --per-head-angles --iters 10 ${cfg:+--scan-config $cfg} ; done ;
               run m3_bench_fastrot 240 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b8t2048 --sweep --sweep-set fastrot ;;
  new_tests)   run gpu_tests_new 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_inline_ptx.py tests/test_mamba3_scan_pallas.py tests/test_selective_scan_pallas.py -k "fast_rotation or hardware or stride" -rA --durations=10 ;;
  e2e1x)       train_steps mamba1 ${E2E1_CFGS:-default} ;;
  defaults_ab) train_steps mamba1 default bwd_adjoint_stride=1+recompute+exactconv default+loopconv
               train_steps mamba3 default fast_rotation=False ;;
  norm_tests)  run gpu_tests_norm 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_add_rms_norm.py -rA ;;
  norm_bench)  run rms_norm_bench 150 python3 benchmarks/bench_rms_norm.py ;;
  norm_ab)     train_steps mamba1 default default+xlanorm ; train_steps mamba3 default default+xlanorm ;;
  angle_pass)  run gpu_tests_angle_pass 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -k "angle_gradient_pass or position_major_theta" -rA
               for sh in b8t2048 b32t512; do for cfg in default qk_gradients_transposed=True,angle_gradient_pass=True; do
                 tag=$(echo "$cfg" | tr '=,' '__'); [ "$cfg" = default ] && cfg=""
                 run m3_profile_${sh}_per_head_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape $sh --per-head-angles --iters 10 ${cfg:+--scan-config $cfg} ; done; done ;;
  qkt_tests)   run gpu_tests_position_major 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -k "position_major or fast_math or transposed_gradient_dots" -rA ;;
  fm_tests)    run gpu_tests_fast_math 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -k "fast_math or bit_identical" -rA ;;
  fr_tests)    run gpu_tests_finite_rows 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_finite_rows.py -rA ;;
  kq_tests)    run gpu_tests_keys_with_queries 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -k "keys_and_queries or bias_gradients_by_xla" -rA ;;
  norm2_tests) run gpu_tests_sum_of_squares 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sum_of_squares.py -rA ;;
  lse_tests)   run gpu_tests_lse 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_log_sum_exp.py -rA ;;
  lse_ab)      train_steps mamba1 default default+pallaslse ; train_steps mamba3 default default+pallaslse ;;
  dx_ab)       train_steps mamba3 default default+sumdx ;;
  dx_bench)    run split_dense_bench 150 python3 benchmarks/bench_split_dense.py --dump /tmp/hlo_dx &&
               tar czf "$OUT/hlo_dx.tgz" -C /tmp hlo_dx ;;   # in_proj's backward alone, both sum orders x XLA options
  dx_ab2)      train_steps mamba3 default default+notritongemm default+sumdx+notritongemm ;;
  qk_tests)    run gpu_tests_qk_norm 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_qk_norm.py -rA ;;
  qk_ab)       train_steps mamba3 default fuse_qk_norm=True ;;
  s29_tests)   run gpu_tests_s29 380 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_mamba3_projected.py tests/test_mamba3_qk_norm.py tests/test_log_sum_exp.py -rA ;;
  proj_bench)  run mamba3_projection_bench 200 python3 benchmarks/bench_mamba3_projection.py ;;
  host_dispatch) for arch in mamba3 mamba1; do run host_dispatch_$arch 90 python3 benchmarks/bench_host_dispatch.py --arch $arch ; done ;;
  flat_tests)  run gpu_tests_flat_state 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flat_train_state.py -rA ;;
  proj_tests)  run gpu_tests_projection 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_mamba3_projected.py -rA ;;
  proj_ab)     train_steps mamba3 default fuse_projection=False projection_row_splits=1 \
                 projection_row_splits=4,num_warps_projection=2,num_warps_projection_grad=4 ;;
  s29_ab)      train_steps mamba3 default fuse_projection=True fuse_qk_norm=True default+sumdx ;;
  conv_tests)  run gpu_tests_conv 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_causal_conv_pallas.py -rA ;;
  m1_keep_tests) run gpu_tests_m1_kept_activations 150 python3 -m pytest -q -p no:cacheprovider tests/test_mamba1_mixer_core.py -k "kept or checked or reaches" -rA ;;
  e2e3x)       train_steps mamba3 ${E2E3_CFGS:-default} ;;
  m3_ab)       for sh in ${M3_SHAPES:-b8t2048 b32t512}; do for tree in ${M3_TREES:-.old}; do tag=$(echo "$tree" | tr -d .)   # A/B against older trees (git archive, carried)
                 PYTHONPATH=$PWD/$tree run m3_profile_${sh}_per_head_$tag 60 python3 $tree/benchmarks/profile_kernels.py mamba3 --shape $sh --per-head-angles --iters 10 ; done; done ;;
  gpu_k)       run gpu_tests_k ${GPU_K_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -k "$GPU_K" -rA --durations=10 ;;
  m3_profx)    for sh in ${M3_SHAPES:-b8t2048 b32t512}; do for cfg in ${M3_CFGS:-default}; do tag=$(echo "$cfg" | tr '=,' '__'); [ "$cfg" = default ] && cfg=""
                 run m3_profile_${sh}_per_head_$tag 60 python3 benchmarks/profile_kernels.py mamba3 --shape $sh --per-head-angles --iters 10 ${cfg:+--scan-config $cfg} ; done; done ;;
  e2e3_fastrot) train_steps mamba3 default fast_rotation=True ;;
  e2e3g)       run e2e_mamba3_gc_freeze 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze ;;
  e2e3_rot)    run e2e_mamba3_rotate_in_chunks 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --scan-config rotate_in_chunk_gradients=True ;;
  m3_head_bench) run m3_bench_head 200 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b8t2048 --sweep --sweep-set head ;
               run m3_bench_head_b32 200 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b32t512 --sweep --sweep-set head ;;
  m3_prof32)   run m3_profile_b32t512 60 python3 benchmarks/profile_kernels.py mamba3 --shape b32t512 --iters 10 ;;
  m3_tests)    run m3_gpu_tests 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mamba3_scan_pallas.py -rA --durations=15 ;;
  m3_profile)  run m3_profile 60 python3 benchmarks/profile_kernels.py mamba3 --iters 10 ;;
  m3_bench)    run m3_bench 300 python3 benchmarks/bench_mamba3_scan.py --ref-iters 3 --sweep --breakdown ;;
  adamw_tests) run adamw_tests 60 python3 -m pytest -q -p no:cacheprovider -x tests/test_fused_adamw.py || OPT=adamw ;;
  adamw)       run adamw 60 python3 benchmarks/bench_fused_adamw.py --no-sweep --iters 10 ;;
  e2e1)        run e2e_mamba1 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas,xla --optimizer $OPT --steps 5 --warmup 2 ;;
  e2e3)        run e2e_mamba3 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas,xla --optimizer $OPT --steps 5 --warmup 2 ;;
  e2e1_old)    PYTHONPATH=$PWD/.old run e2e_mamba1_old 130 python3 .old/benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 ;;
  e2e3_old)    PYTHONPATH=$PWD/.old run e2e_mamba3_old 130 python3 .old/benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 ;;
  remat1)      run e2e_mamba1_remat_layer 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --remat layer ;
               run e2e_mamba1_remat_dots 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --remat dots ;;
  noguard1)    run e2e_mamba1_noguard 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --no-guard ;;
  soak)        run soak_f16 240 python3 benchmarks/soak_f16.py ;;
  decode)      run decode 240 python3 benchmarks/bench_decode.py --arch mamba1 ;;
  dp2)         run dp_equivalence 50 python3 tests/data_parallel_worker.py "$OUT/dp2.json" mamba1 mamba1_fsdp mamba3 f16_scaler ;
               run dp_throughput 90 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer $OPT --steps 5 --warmup 2 --devices 2 ;;
  anchors_build) if [ ! -f .anchors/build.py ]; then   # .anchors is git-ignored: the call must carry it
                   echo "anchors_build: .anchors/build.py missing (copy the anchors folder to .anchors and carry .anchors)" | tee "$OUT/anchors_build.log"; exit 2; fi
               setsid nohup python3 .anchors/build.py /tmp/ab > "$OUT/anchors_build.log" 2>&1 < /dev/null & ;;
  anchors_ss)  if [ ! -f .anchors/build.py ]; then echo "anchors_ss: .anchors/build.py missing (carry .anchors)" | tee "$OUT/anchors_build.log"; exit 2; fi
               setsid nohup python3 .anchors/build.py /tmp/ab ss > "$OUT/anchors_build.log" 2>&1 < /dev/null & ;;
  side_ops3)   wait_ss && XLA_PYTHON_CLIENT_PREALLOCATE=false run side_by_side_ops_mamba3 420 python3 -c "import sys; sys.argv = ['x', '/tmp/ab', 'none']; sys.path[:0] = ['.anchors', '.']; import side_by_side as s; [s.m3_op(b=b, l=l) for _ in range(${SIDE_REPS:-1}) for b, l in ((8, 2048), (32, 512), (2, 8192))]" ;;   # SIDE_REPS=2: each shape again once everything is compiled
  m3_stored)   run m3_bench_stored 300 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b8t2048 --sweep --sweep-set stored ;
               run m3_bench_stored_b32 200 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b32t512 --sweep --sweep-set stored ;;
  m3_qk)       run m3_bench_qk 300 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b8t2048 --sweep --sweep-set qk ;
               run m3_bench_qk_b32 240 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b32t512 --sweep --sweep-set qk ;;
  m3_qk16)     run m3_bench_qk16 200 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b8t2048 --sweep --sweep-set qk16 ;
               run m3_bench_qk16_b32 200 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b32t512 --sweep --sweep-set qk16 ;;
  m3_prof16)   for sh in b8t2048 b32t512; do run m3_profile_$sh 60 python3 benchmarks/profile_kernels.py mamba3 --shape $sh --iters 10 ;
               run m3_profile_${sh}_dqk_f32 60 python3 benchmarks/profile_kernels.py mamba3 --shape $sh --iters 10 --scan-config qk_gradient_dtype=float32 ; done ;;
  e2e3_qk16)   run e2e_mamba3_dqk_f32 170 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --scan-config qk_gradient_dtype=float32 --profile 3 ;;
  m3_adt)      run m3_bench_adt 200 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b8t2048 --sweep --sweep-set adt ;
               run m3_bench_adt_b32 200 python3 benchmarks/bench_mamba3_scan.py --ref-iters 1 --impls pallas --shapes b32t512 --sweep --sweep-set adt ;;
  dispatch)    for sh in ${DISPATCH_SHAPES:-b8t2048}; do run dispatch_$sh 120 python3 benchmarks/bench_dispatch.py --shape $sh ;
               XLA_FLAGS="--xla_gpu_enable_command_buffer=" run dispatch_${sh}_no_command_buffers 120 python3 benchmarks/bench_dispatch.py --shape $sh ; done ;;
  e2e3_adt)    run e2e_mamba3_adt_in_keys 170 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --scan-config adt_in_values=False --profile 3 ;;
  e2e3_stored) run e2e_mamba3_stored 170 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --scan-config stored_scores=True,stored_ungated=True --profile 3 ;;
  e2e3_keys)   run e2e_mamba3_stored_for_keys 170 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --scan-config stored_scores=True,stored_ungated=True,stored_for_keys=True --profile 3 ;;
  side_ops)    wait_anchors && run side_by_side_ops 240 python3 .anchors/side_by_side.py /tmp/ab ops --project . ;;
  side_train)  wait_anchors && run side_by_side_train 200 python3 .anchors/side_by_side.py /tmp/ab train ;;
  side_train3) wait_ss && run side_by_side_train_mamba3 420 python3 -c "import sys; sys.argv = ['x', '/tmp/ab', 'none']; sys.path.insert(0, '.anchors'); import side_by_side as s; s.train('Mamba3')" ;;
  side_train1) wait_anchors && run side_by_side_train_mamba1 120 python3 -c "import sys; sys.argv = ['x', '/tmp/ab', 'none']; sys.path.insert(0, '.anchors'); import side_by_side as s; s.train('Mamba1')" ;;
  side_ops1)   wait_ss && XLA_PYTHON_CLIENT_PREALLOCATE=false run side_by_side_ops_mamba1 200 python3 -c "import sys; sys.argv = ['x', '/tmp/ab', 'none']; sys.path.insert(0, '.anchors'); sys.path.insert(0, '.'); import side_by_side as s; [s.m1_op(**k) for k in (dict(b=8, l=2048), dict(b=32, l=256), dict(b=2, l=8192))]" ;;
  side_long)   wait_anchors && run side_by_side_train_long 150 python3 -c "import sys; sys.argv = ['x', '/tmp/ab', 'none']; sys.path.insert(0, '.anchors'); import side_by_side as s; s.train('Mamba1', b=1, l=65536)" ;;
  e2e1_prof)   run e2e_mamba1_profile 170 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --profile 3 ;;
  mixer_bench) run mamba1_mixer_bench 200 python3 benchmarks/bench_mamba1_mixer.py ;;
  scan_sweep)  run scan_sweep_sub_chunk 240 python3 benchmarks/bench_selective_scan.py --sweep --sweep-set sub-chunk --shapes b8t2048 --impls pallas --iters 10 ;;
  m1_prefetch) run gpu_tests_m1_prefetch 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_selective_scan_pallas.py -k prefetching -rA ;
               run scan_sweep_prefetch 240 python3 benchmarks/bench_selective_scan.py --sweep --sweep-set prefetch --shapes b8t2048 --impls pallas --iters 10 ;
               run e2e_mamba1_prefetch 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze --scan-config bwd_prefetch_rows=False ;;
  m1_prof)     for cfg in ${M1_CFGS:-default bwd_adjoint_stride=2}; do tag=$(echo "$cfg" | tr '=,' '__')
                 [ "$cfg" = default ] && cfg=""
                 run m1_profile_${M1_SHAPE:-b8t2048}_$tag 90 python3 benchmarks/profile_kernels.py mamba1 --shape ${M1_SHAPE:-b8t2048} --iters 10 ${cfg:+--scan-config $cfg} ; done ;;
  scan_parallel) run scan_sweep_parallel 240 python3 benchmarks/bench_selective_scan.py --sweep --sweep-set parallel --shapes b8t2048 --impls pallas --iters 10 ;;
  e2e1p)       run e2e_mamba1 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 ;;
  e2e3p)       run e2e_mamba3 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 ;;
  e2e1_dump)   run e2e_mamba1_profile 200 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 6 --warmup 2 --steady 10 --profile 3 --xla-dump /tmp/hlo1 ${PROF_TREE:+--no-flat} ;
               pack_hlo /tmp/hlo1 "$OUT/hlo_mamba1.txt.gz" ;;
  e2e3_dump)   run e2e_mamba3_profile 200 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 6 --warmup 2 --steady 10 --profile 3 --xla-dump /tmp/hlo3 ${M3_PROF_CFG:+--scan-config $M3_PROF_CFG} ${PROF_TREE:+--no-flat} ;
               pack_hlo /tmp/hlo3 "$OUT/hlo_mamba3.txt.gz" ;;
  conv_bench)  run causal_conv_bench 150 python3 benchmarks/bench_causal_conv.py ;;
  tests_m1)    run gpu_tests_mamba1 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_causal_conv_pallas.py tests/test_mamba1_mixer_core.py tests/test_selective_scan_pallas.py -rA --durations=20 ;;
  e2e3_b2b_old) cp benchmarks/bench_train_step.py .old/benchmarks/ ;
               PYTHONPATH=$PWD/.old run e2e_mamba3_profile_b2b_old 170 python3 .old/benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 5 --warmup 2 --steady 10 --profile 6 --profile-back-to-back ;;
  e2e3_b2b)    run e2e_mamba3_profile_b2b 170 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 5 --warmup 2 --steady 10 --profile 6 --profile-back-to-back ;;
  e2e3_prof)   run e2e_mamba3_profile 170 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --profile 3 ;;
  e2e3_gc)     run e2e_mamba3_gc_freeze 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze ;
               run e2e_mamba3_gc_default 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 ;;
  e2e1_pf)     run e2e_mamba1_prefetch_${PF_TAG:-a} 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze --scan-config bwd_prefetch_rows=False ;;
  e2e1_stride) train_steps mamba1 default bwd_adjoint_stride=2 ;;
  e2e1_gc)     run e2e_mamba1_gc_freeze 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 20 --gc-freeze ;;
  e2e3_nocb)   XLA_FLAGS="--xla_gpu_enable_command_buffer=" run e2e_mamba3_no_command_buffers 130 python3 benchmarks/bench_train_step.py --arch mamba3 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 ;;
  e2e1_nocb)   XLA_FLAGS="--xla_gpu_enable_command_buffer=" run e2e_mamba1_no_command_buffers 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 ;;
  e2e1_cb)     XLA_FLAGS="--xla_gpu_enable_command_buffer=+CUSTOM_CALL,+CUBLASLT,+CUBLAS,+FUSION --xla_gpu_graph_min_graph_size=1" run e2e_mamba1_more_command_buffers 130 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 ;;
  gpu_auto)    run gpu_tests_auto 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_selective_scan_pallas.py -k automatic_choice ;;
  mosaic_fwd)  run gpu_tests_mosaic 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_selective_scan_mosaic.py ;
               run mosaic_forward_bench 150 python3 benchmarks/bench_mosaic_forward.py ;
               run scan_sweep_mosaic 200 python3 benchmarks/bench_selective_scan.py --sweep --sweep-set mosaic --shapes b8t2048 --impls pallas --iters 10 ;;
  mosaic_tests) run gpu_tests_mosaic 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_selective_scan_mosaic.py ;;
  mosaic_bench) run mosaic_forward_bench 100 python3 benchmarks/bench_mosaic_forward.py ;;
  e2e1_mosaic) run e2e_mamba1_mosaic_forward 170 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 10 --warmup 2 --steady 10 --scan-config fwd_mosaic=True,bwd_mosaic=True --profile 3 ;;
  seq_bench)   run sequence_parallel_overhead 200 python3 benchmarks/bench_sequence_parallel.py ;;
  multi_equal) run dp_equivalence_all_gpus 300 python3 tests/data_parallel_worker.py "$OUT/dp_all.json" ;
               run sp_equivalence_4_gpus 400 python3 tests/sequence_parallel_worker.py "$OUT/sp4.json" ;;
  scaling)     run scaling 3000 python3 benchmarks/bench_scaling.py ;;
  e2e1_long)   run e2e_mamba1_long 170 python3 benchmarks/bench_train_step.py --arch mamba1 --impl pallas --optimizer fused --steps 5 --warmup 2 --batch-size 1 --seq-len 65536 ;;
esac; done
echo "=== done ==="
