#!/usr/bin/env bash
# Every GPU measurement of ddpkit, for any number of GPUs, one mode per 10-minute device call:
#
#   bash benchmarks/gpu.sh tests        # the GPU tests (tests/gpu): NCCL setup, flight
#                                       # recorder, faults, graphed steps, exact resume;
#                                       # `tests FILE...`: only those (a short lease)
#   bash benchmarks/gpu.sh hang         # a GPU that never finishes; OOM verdicts; their cost
#   bash benchmarks/gpu.sh launcher     # doctor, the demo, start-up against torchrun
#   bash benchmarks/gpu.sh collectives  # every collective at 2..N GPUs, eager and -G
#   bash benchmarks/gpu.sh training     # bench ddp: GPT b8/b32 with --graphs, ResNet b64
#   bash benchmarks/gpu.sh faults       # only the NCCL fault tests, on every GPU
#   bash benchmarks/gpu.sh clients      # bench ddp against Accelerate and Fabric
#   bash benchmarks/gpu.sh speed        # what step timing costs (GPT-2-small bf16; the CPU
#                                       # demo's model), doctor's transport line
#   bash benchmarks/gpu.sh shard        # bench ddp --shard (DDP against FSDP2) with --grow
#   bash benchmarks/gpu.sh memory       # the memory doctor: a real CUDA OOM's verdict, the
#                                       # snapshot, s.fit; what the watch costs (GPT-2-small)
#   bash benchmarks/gpu.sh stopflag     # what reading s.stop_requested every step costs
#                                       # (GPT-2-small bf16, b4 and b8; forced compare at 1 GPU)
#   bash benchmarks/gpu.sh rescue       # what keeping the last completed step costs (issue 38)
#   bash benchmarks/gpu.sh profile      # ddpkit profile's traces on GPUs, its cost (issue 39)
#   bash benchmarks/gpu.sh owed         # a short lease: every GPU test (the profile's first),
#                                       # then the snapshot's figure, bounded (~9 minutes)
#   bash benchmarks/gpu.sh rest         # what owed leaves (~8 minutes): the restart against
#                                       # torchrun, what profiling costs, the wide MLP's snapshot
#   bash benchmarks/gpu.sh restart      # failure to the restarted job's first step: torchrun,
#                                       # ddpkit cold, ddpkit with warm spares (issue 38;
#                                       # RESTART_RUNS=3 RESTART_SLEEP=0.3 s a step)
#
# Run from the repository root (the device tool does): ddpkit from the tree (PYTHONPATH=src).
# Results land in $OUT (default out/); a short table is printed last. NVLink multicast stays off
# (the device's notes), in every worker too (they inherit this environment).
set -u
MODE=${1:?"mode: tests | owed | rest | hang | launcher | collectives | training | faults | clients | speed | shard | stopflag | memory | rescue | restart | profile"}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
counts() {  # 1 2 4 ... N
  local c=1 out=""
  while [ "$c" -le "$N" ]; do out="$out $c"; c=$((c * 2)); done
  case " $out " in *" $N "*) ;; *) out="$out $N" ;; esac
  echo "$out" | tr ' ' '\n' | grep . | paste -sd, -
}
machine() {
  { nvidia-smi -L; python3 -c "import sys, torch; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    nproc; } > "$OUT/machine.txt" 2>&1
  cat "$OUT/machine.txt"
}

case "$MODE" in
memory)
  machine
  timeout 300 python3 -m pytest -m gpu tests/gpu/test_memory_gpu.py -v -s -p no:cacheprovider \
    >"$OUT/memory_tests.txt" 2>&1
  timeout 200 python3 benchmarks/memory_watch_cost.py --batch 8 >"$OUT/memory_watch_cost.txt" 2>&1 ||
    echo "FAILED memory_watch_cost"
  grep -E "verdict:|fix:|torch:|snapshot |fitted|small |PASSED|FAILED|passed|failed|Error" \
    "$OUT/memory_tests.txt" | cut -c1-600 | tail -30
  cat "$OUT/memory_watch_cost.txt" | tail -12
  ;;
stopflag)
  machine
  for batch in 4 8; do
    if [ "$N" -ge 2 ]; then
      timeout 250 python3 -m ddpkit run -n 2 benchmarks/stop_flag_cost.py --device cuda \
        --model gpt --batch "$batch" --rounds 8 >"$OUT/stop_flag_b$batch.txt" 2>&1
    else  # one GPU: the many-rank path forced on a group of one
      timeout 250 python3 benchmarks/stop_flag_cost.py --device cuda --model gpt \
        --batch "$batch" --rounds 8 --force >"$OUT/stop_flag_b$batch.txt" 2>&1
    fi
  done
  grep -h -A3 "s.stop_requested every" "$OUT"/stop_flag_b*.txt | sed 's/^\[rank 0\] //'
  ;;
hang)  # issue 35: a GPU that never finishes, the OOM verdicts on a GPU, what the watch costs
  machine
  timeout 420 python3 -m pytest -m gpu tests/gpu/test_gpu_hang.py tests/gpu/test_memory_gpu.py \
    -v -s -p no:cacheprovider >"$OUT/gpu_hang_tests.txt" 2>&1
  timeout 150 python3 benchmarks/gpu_wait_cost.py --batch 8 >"$OUT/gpu_wait_cost.txt" 2>&1 ||
    echo "FAILED gpu_wait_cost"
  grep -E "root cause|fix:|verdict:|took|PASSED|FAILED|passed|failed|Error" \
    "$OUT/gpu_hang_tests.txt" | cut -c1-400 | tail -40
  cat "$OUT/gpu_wait_cost.txt" | tail -6
  ;;
tests | faults)
  machine
  what=tests/gpu
  [ "$MODE" = faults ] && what=tests/gpu/test_nccl_faults.py
  [ $# -gt 1 ] && what="${*:2}"  # a short lease: only the files named
  # shellcheck disable=SC2086 # the files named, one word each
  timeout 580 python3 -m pytest -m gpu $what -v -s -p no:cacheprovider >"$OUT/gpu_tests.txt" 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|resume on|stall to report" \
    "$OUT/gpu_tests.txt" | tail -40
  ;;
launcher)
  machine
  python3 -m ddpkit doctor >"$OUT/doctor.txt" 2>&1
  echo "doctor exit $?" >>"$OUT/doctor.txt"
  python3 -m ddpkit demo 2>&1 | tr '\r' '\n' | grep -v '%|' >"$OUT/demo.txt"
  timeout 300 python3 benchmarks/launch_vs_torchrun.py --runs 5 --exit-runs 10 >"$OUT/launch.txt" 2>&1
  tail -3 "$OUT/doctor.txt"; tail -3 "$OUT/demo.txt"; tail -8 "$OUT/launch.txt"
  ;;
collectives)
  machine
  mkdir -p "$OUT/bench"
  for g in $(counts | tr ',' ' '); do
    [ "$g" -lt 2 ] && continue
    for c in all_reduce all_gather reduce_scatter alltoall broadcast sendrecv; do
      timeout 120 python3 -m ddpkit bench "$c" -b 8 -e 1G -f 2 -g "$g" \
        --json "$OUT/bench/${c}_g$g.json" >"$OUT/bench/${c}_g$g.txt" 2>&1 || echo "FAILED $c -g $g"
      timeout 120 python3 -m ddpkit bench "$c" -b 8 -e 1G -f 2 -g "$g" -G 20 \
        --json "$OUT/bench/${c}_g${g}_graph.json" >"$OUT/bench/${c}_g${g}_graph.txt" 2>&1 ||
        echo "FAILED $c -g $g -G"
    done
  done
  grep -H "Avg bus bandwidth" "$OUT"/bench/*.txt
  ;;
training)
  machine
  for batch in 8 32; do
    echo "### gpt b$batch"
    timeout 280 python3 -m ddpkit bench ddp --model gpt --gpus "$(counts)" --batch "$batch" \
      --steps 40 --graphs --json "$OUT/ddp_gpt_b$batch.json" 2>&1 | grep -v "^ddpkit: run"
  done | tee "$OUT/training.txt"
  ;;
clients)
  machine
  timeout 580 python3 -m ddpkit bench ddp --model gpt --gpus "$(counts)" --batch 8 --steps 40 \
    --frameworks --json "$OUT/ddp_clients.json" 2>&1 | grep -v "^ddpkit: run" | tee "$OUT/clients.txt"
  ;;
speed)
  machine
  for batch in 8 12; do
    timeout 200 python3 benchmarks/step_timing_cost.py --device cuda --model gpt --batch "$batch" \
      --steps 10 --rounds 40 >"$OUT/step_timing_gpt_b$batch.txt" 2>&1 || echo "FAILED gpt b$batch"
  done
  timeout 200 python3 benchmarks/step_timing_cost.py --device cpu --model digits --batch 32 \
    --steps 50 --rounds 40 >"$OUT/step_timing_digits_cpu.txt" 2>&1 || echo "FAILED digits"
  timeout 150 python3 -m ddpkit run -n gpu benchmarks/bucket_hook_cost.py 2>&1 |
    grep -v "^ddpkit:" >"$OUT/bucket_hook_cost.txt"
  timeout 120 python3 -m ddpkit doctor >"$OUT/doctor.txt" 2>&1
  cat "$OUT"/step_timing_*.txt "$OUT/bucket_hook_cost.txt"
  grep -E "smoke|NCCL|transport" "$OUT/doctor.txt"
  ;;
shard)
  machine
  timeout 150 python3 -m ddpkit run -n gpu benchmarks/reshard_choice.py 2>&1 |
    grep -v "^ddpkit:" | tee "$OUT/reshard.txt"
  timeout 100 python3 -m ddpkit run -n gpu benchmarks/fsdp_overhead.py 2>&1 |
    grep -v "^ddpkit:" | tee "$OUT/fsdp_overhead.txt"
  # batch 8 is bound by the host's time per step (FSDP2's hooks), batch 32 by the GPU's
  timeout 120 python3 -m ddpkit bench ddp --shard --gpus "$(counts)" --batch 32 --steps 20 \
    --json "$OUT/shard_b32.json" 2>&1 | tee "$OUT/shard_b32.txt"
  timeout 420 python3 -m ddpkit bench ddp --shard --gpus "$(counts)" --batch 8 --steps 20 \
    --grow --json "$OUT/shard.json" 2>&1 | tee "$OUT/shard.txt"
  ;;
rescue)  # issue 38: the step-boundary snapshot against the step, at 1 GPU and at 2 when lent
  machine
  for run in ${RESCUE_MODELS:-wide:64 wide:512 gpt:8 resnet:64}; do  # model:batch
    set -- ${run/:/ }
    if [ "$N" -ge 2 ]; then
      timeout 250 python3 -m ddpkit run -n 2 benchmarks/rescue_snapshot_cost.py --model "$1" \
        --batch "$2" >"$OUT/rescue_$1_b$2.txt" 2>&1
    else  # one GPU: armed as a job of two would be (under ddpkit run: the streams' file too)
      timeout 250 python3 -m ddpkit run -n 1 benchmarks/rescue_snapshot_cost.py --model "$1" \
        --batch "$2" >"$OUT/rescue_$1_b$2.txt" 2>&1
    fi
  done
  grep -h -A4 "^.*model " "$OUT"/rescue_*.txt | sed 's/^\[rank 0\] //'
  ;;
profile)  # issue 39: ddpkit profile on GPUs (CUDA and NCCL kernels in the traces), its cost
  machine
  timeout 300 python3 -m pytest -m gpu tests/gpu/test_profile_gpu.py -v -s -p no:cacheprovider \
    >"$OUT/profile_tests.txt" 2>&1
  (cd benchmarks && timeout 250 python3 profile_cost.py --device cuda --model gpt --batch 8) \
    >"$OUT/profile_cost.txt" 2>&1 || echo "FAILED profile_cost"
  grep -E "recorded on|PASSED|FAILED|passed|failed|Error" "$OUT/profile_tests.txt" | tail -12
  tail -4 "$OUT/profile_cost.txt"
  ;;
restart)  # issue 38: a failure to the first step of the restarted job, against torchrun
  machine
  if [ "$N" -ge 2 ]; then ranks=2 fail=1; else ranks=1 fail=0; fi
  timeout 420 python3 benchmarks/restart_cost.py --ranks "$ranks" --fail-rank "$fail" \
    --runs "${RESTART_RUNS:-3}" --sleep "${RESTART_SLEEP:-0.3}" --keep "$OUT/restart_runs" >"$OUT/restart_cost.txt" 2>&1 || echo "FAILED restart_cost"
  tar czf "$OUT/restart_runs.tgz" -C "$OUT" restart_runs && rm -r "$OUT/restart_runs"
  tail -6 "$OUT/restart_cost.txt"
  ;;
owed)  # one call for a short lease, the most owed first, each bounded (whatever the lease cut
  # short still comes back): every GPU test, the profile's first (issues 36, 39), then the
  # snapshot's figure (issue 38); `rest` is the second call (the restart, what profiling costs)
  machine
  ls tests/gpu/test_*.py | grep -v test_profile_gpu | { echo tests/gpu/test_profile_gpu.py; cat; } |
    xargs timeout 480 python3 -m pytest -m gpu -v -s -p no:cacheprovider >"$OUT/gpu_tests.txt" 2>&1
  grep -E "recorded on|PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/gpu_tests.txt" | tail -40
  timeout 55 python3 -m ddpkit run -n 1 benchmarks/rescue_snapshot_cost.py --model gpt \
    --batch 8 --blocks 6 >"$OUT/rescue_gpt_b8.txt" 2>&1
  grep -h -A4 "^.*model " "$OUT"/rescue_*.txt | sed 's/^\[rank 0\] //'
  ;;
rest)  # the second call of a short lease, after owed: the restart against torchrun, what
  # profiling costs, the snapshot on the wide MLP (issues 38, 39)
  machine
  if [ "$N" -ge 2 ]; then ranks=2 fail=1; else ranks=1 fail=0; fi
  timeout 150 python3 benchmarks/restart_cost.py --ranks "$ranks" --fail-rank "$fail" --runs 3 \
    --sleep 0.3 >"$OUT/restart_cost.txt" 2>&1 || echo "FAILED restart_cost"
  tail -6 "$OUT/restart_cost.txt"
  timeout 60 python3 -m ddpkit run -n 1 benchmarks/rescue_snapshot_cost.py --model wide \
    --batch 512 >"$OUT/rescue_wide_b512.txt" 2>&1
  grep -h -A4 "^.*model " "$OUT"/rescue_*.txt | sed 's/^\[rank 0\] //'
  (cd benchmarks && timeout 250 python3 profile_cost.py --device cuda --model gpt --batch 8) \
    >"$OUT/profile_cost.txt" 2>&1 || echo "FAILED profile_cost"
  tail -4 "$OUT/profile_cost.txt"
  ;;
*)
  echo "unknown mode $MODE" >&2
  exit 2
  ;;
esac
