#!/usr/bin/env bash
# Everything that needs the lent GPU machine: GPU tests, store bandwidth (disk and tmpfs), the disk sweep, the
# training benchmark, the session and profiler figures, the 8B scenario and its DeepSpeed baseline. Writes logs
# under $OUT (or ./out); the device tool brings back at most 8 files: a train run writes train.json and
# train.log (train_$TAG.* with TAG set, so several shapes share one $OUT) beside the one device.txt, and `all`
# writes more than 8. Usage on the device:
#   bash tests/gpu_session.sh [tests|store|sweep|train|session|finetune|deepspeed|compare|trainer|moments|quality|ranks|bf16|ab|ab-bench|all]
# Environment: TESTS (pytest targets, default tests), NO_TRAIN (tests: skip the quick-start train), TOTAL (sweep:
# bytes a point, default 2GiB), ROWS, STEPS (default 6; finetune/deepspeed 2), BENCH_ARGS (bench train's shape
# options), TAG, FT_ARGS / DS_ARGS (finetune_8b.py / finetune_8b_deepspeed.py options), LOSSES (trainer: the
# hf_trainer_8b.py --loss values to run after finetune_8b.py, default "liger chunked"), QROWS / QSTEPS / QARGS
# (quality: examples/moment_quality.py's rows, default all six; steps, default 1000; more of its options); ranks:
# NPROCS (GPU counts, default "1 2"), NO_RANKS_RUNS / NO_RANKS_TESTS (skip the 8B runs / the NCCL tests),
# RUN_TIMEOUT / TESTS_TIMEOUT (seconds, each run / the tests).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
what=${1:-all}
status=0  # the first failing test run, plan or 8B run's exit status: the script's own at the end (later parts still run)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if ls .whl/deepspeed-*.whl >/dev/null 2>&1; then  # DeepSpeed baselines: see ../shared/tools/deepspeed-wheels.sh
  mkdir -p /tmp/aio && for f in .whl/*.deb; do dpkg-deb -x "$f" /tmp/aio; done
  ln -sf /tmp/aio/usr/lib/x86_64-linux-gnu/libaio.so.1 /tmp/aio/usr/lib/x86_64-linux-gnu/libaio.so
  export CPATH=/tmp/aio/usr/include LIBRARY_PATH=/tmp/aio/usr/lib/x86_64-linux-gnu \
         LD_LIBRARY_PATH=/tmp/aio/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-} \
         TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
fi
if [ ! -s "$OUT/device.txt" ]; then  # once per $OUT
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  python3 -c "import torch, os; print('torch', torch.__version__, 'cpus', os.cpu_count())" | tee -a "$OUT/device.txt"
fi
if [[ $what == tests || $what == all ]]; then
  # -v: each test's name and outcome as it ends, so a run cut by a time limit still says which test failed
  # TIERSTORE_FAILURES_NOW: a failure's traceback as the test ends (tests/conftest.py), not only in the summary
  TIERSTORE_FAILURES_NOW=1 python3 -m pytest -v --tb=short -m gpu -s -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -60 || status=$(( status ? status : $? ))
  [[ -z ${NO_TRAIN:-} ]] && python3 -m runtime.cli train 2>&1 | tee "$OUT/train_default.log" | tail -12
fi
if [[ $what == store || $what == all ]]; then
  mkdir -p /var/tmp/tierstore-bench
  python3 -m runtime.cli bench store --nvme-dir /var/tmp/tierstore-bench --total 4GiB --json "$OUT/store_disk.json" 2>&1 | tee "$OUT/store_disk.log" | grep -v INFO
  python3 -m runtime.cli bench store --nvme-dir /dev/shm --total 4GiB --json "$OUT/store_tmpfs.json" 2>&1 | tee "$OUT/store_tmpfs.log" | grep -v INFO
fi
if [[ $what == sweep ]]; then  # which IO shape the disk reads fastest (tiers.nvme.io_threads / block_size)
  mkdir -p /var/tmp/tierstore-bench
  python3 -m runtime.cli bench store --nvme-dir /var/tmp/tierstore-bench --disk-sweep --total ${TOTAL:-2GiB} 2>&1 | tee "$OUT/disk_sweep.log" | grep -v INFO
fi
if [[ $what == train || $what == all ]]; then
  mkdir -p /var/tmp/tierstore-train
  # BENCH_ARGS: another shape, e.g. "--model hf-llama --hidden 2048 --layers 28 --heads 16 --kv-heads 4 --tied --seq 2048"
  python3 -m runtime.cli bench train --preset 1.35b ${BENCH_ARGS:-} --rows ${ROWS:-torch,host,host-f50,gpu-weights-f50,torch-accum8,host-accum8,host-accum8-f50,nvme} --steps ${STEPS:-6} --nvme-dir /var/tmp/tierstore-train --json "$OUT/train${TAG:+_$TAG}.json" 2>&1 | tee "$OUT/train${TAG:+_$TAG}.log" | awk '!/INFO/ || /train_bench: row /'
fi
if [[ $what == finetune || $what == compare ]]; then  # the 8B workstation scenario (issue 15): its plan, then two steps
  # compare: this, then DeepSpeed (the block below) in one call; give both the shape: FT_ARGS="--layers 16" DS_ARGS="--layers 16 ..."
  mkdir -p /var/tmp/ts-8b
  # FT_ARGS: e.g. "--global-batch 8 --micro-batch 2" (a shorter step, another micro-batch)
  python3 examples/finetune_8b.py --plan-only --nvme-dir /var/tmp/ts-8b ${FT_ARGS:-} 2>&1 | tee "$OUT/finetune_plan${TAG:+_$TAG}.log" || status=$(( status ? status : $? ))
  python3 examples/finetune_8b.py --nvme-dir /var/tmp/ts-8b --steps ${STEPS:-2} ${FT_ARGS:-} 2>&1 | tee "$OUT/finetune${TAG:+_$TAG}.log" | tr '\r' '\n' | tail -60 || status=$(( status ? status : $? ))
fi
if [[ $what == deepspeed || $what == compare ]]; then  # DeepSpeed ZeRO-3 offload on the same scenario (DS_ARGS: e.g. "--layers 16 --offload nvme")
  mkdir -p /var/tmp/ds-8b
  python3 examples/finetune_8b_deepspeed.py --steps ${STEPS:-2} ${DS_ARGS:-} 2>&1 | tee "$OUT/deepspeed.log" | tr '\r' '\n' | grep -v "^step .*micro-batch" | tail -40 || status=$(( status ? status : $? ))
fi
if [[ $what == trainer ]]; then  # the 8B scenario: finetune_8b.py, then an unchanged HF Trainer per loss (issue 41), one call
  mkdir -p /var/tmp/ts-8b
  python3 examples/finetune_8b.py --nvme-dir /var/tmp/ts-8b --steps ${STEPS:-2} ${FT_ARGS:-} 2>&1 | tr '\r' '\n' > "$OUT/trainer_example.log" || status=$(( status ? status : $? ))
  grep -E "^step [0-9]+/[0-9]+: loss|falling|Error" "$OUT/trainer_example.log" | sed "s/^/example: /"
  for loss in ${LOSSES:-liger chunked}; do
    python3 examples/hf_trainer_8b.py --nvme-dir /var/tmp/ts-8b --steps ${STEPS:-2} --loss $loss ${FT_ARGS:-} 2>&1 | tr '\r' '\n' > "$OUT/trainer_$loss.log" || status=$(( status ? status : $? ))
    grep -E "^step [0-9]+/[0-9]+: loss|clip_grad_norm_|falling|Error|error" "$OUT/trainer_$loss.log" | sed "s/^/trainer-$loss: /"
  done
fi
if [[ $what == ab ]]; then  # the 8B command, STEPS steps (default 1), for each code tree in AB_TREES, on one machine
  # AB_TREES: folders holding runtime/, tierstore/ and examples/ of one commit each, made before the call with e.g.
  # `mkdir ab_main && git archive main runtime tierstore examples | tar -x -C ab_main` (ab_*/ is git-ignored: name
  # the folders in the device call's carry)
  for tree in ${AB_TREES:?set AB_TREES to the code trees to compare}; do
    rm -rf /var/tmp/ts-ab && mkdir -p /var/tmp/ts-ab
    name=$(basename "$tree")
    (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 examples/finetune_8b.py --nvme-dir /var/tmp/ts-ab --steps ${STEPS:-1} ${FT_ARGS:-}) 2>&1 \
      | tr '\r' '\n' > "$OUT/ab_$name.log" || status=$(( status ? status : $? ))
    grep -E "^step [0-9]+/[0-9]+: loss|host gradient sums" "$OUT/ab_$name.log" | sed "s/^/$name: /"
  done
  rm -rf /var/tmp/ts-ab
fi
if [[ $what == ab-bench ]]; then  # tierstore bench train (ROWS, default its base rows) for each code tree in AB_TREES, one machine
  for tree in ${AB_TREES:?set AB_TREES to the code trees to compare}; do
    rm -rf /var/tmp/ts-ab && mkdir -p /var/tmp/ts-ab
    name=$(basename "$tree")
    (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 -m runtime.cli bench train ${BENCH_ARGS:-} ${ROWS:+--rows $ROWS} --steps ${STEPS:-6} \
      --nvme-dir /var/tmp/ts-ab) > "$OUT/abbench_$name.log" 2>&1 || status=$(( status ? status : $? ))
    grep -vE "INFO|WARNING" "$OUT/abbench_$name.log" | sed "s/^/$name: /" | tail -25
  done
  rm -rf /var/tmp/ts-ab
fi
if [[ $what == moments ]]; then  # issue 43 on one GPU: the CPU AdamW table per moment_dtype, the bench rows, then the
  # 8B scenario with fp32 moments (host budget 100 GiB) and with int8 moments (64 GiB), one after the other in this call
  python3 -m runtime.bench.adam_bench --threads ${THREADS:-16} 2>&1 | tee "$OUT/adam_bench.log" | grep -v INFO
  mkdir -p /var/tmp/ts-8b
  for run in "fp32:--host-budget 100GiB" "int8:--host-budget 64GiB --set optimizer.moment_dtype=int8"; do
    tag=${run%%:*}; args=${run#*:}
    python3 examples/finetune_8b.py --nvme-dir /var/tmp/ts-8b --steps ${STEPS:-2} $args ${FT_ARGS:-} 2>&1 | tr '\r' '\n' > "$OUT/moments8b_$tag.log" || status=$(( status ? status : $? ))
    grep -E "^step [0-9]+/[0-9]+: loss|memory plan|nvme|host .*GiB|Error|error" "$OUT/moments8b_$tag.log" | head -40 | sed "s/^/$tag: /"
    rm -rf /var/tmp/ts-8b/*
  done
fi
if [[ $what == ranks ]]; then  # issue 42: the 8B scenario on N GPUs of this host (NPROCS, default "1 2"), one after the
  # other in this call (each rank: 24 GiB cap, its micro-batches; host budget 100 GiB for the node), then its tests over NCCL
  mkdir -p /var/tmp/ts-8b
  most=$(echo ${NPROCS:-1 2} | tr ' ' '\n' | sort -n | tail -1)
  [[ -n ${NO_RANKS_RUNS:-} ]] && most=1 && NPROCS=" "  # the tests alone (NO_RANKS_TESTS: the runs alone)
  if [ "$most" -gt 1 ]; then  # the ranks' broadcasts and reductions without the model: NCCL's choice, then Simple
    for proto in "" Simple; do
      env ${proto:+NCCL_PROTO=$proto} timeout 120 python3 -m torch.distributed.run --nproc-per-node $most --standalone \
        -m runtime.bench.collectives_bench 2>&1 | grep -v "^W\|OMP_NUM_THREADS\|^\*" | tee -a "$OUT/collectives.log"
    done
  fi
  for n in ${NPROCS:-1 2}; do
    [[ $n =~ ^[0-9]+$ ]] || continue
    # the node's memory in use, sampled every second while the run lasts (MemTotal - MemAvailable: every rank's
    # pinned and pageable memory, the page cache's dirty pages not counted): its peak beside the ranks' summed RSS
    (peak=0; while sleep 1; do used=$(awk '/MemTotal/{t=$2}/MemAvailable/{a=$2}END{print t-a}' /proc/meminfo)
       [ "$used" -gt "$peak" ] && peak=$used && echo "$peak" > "$OUT/node_mem_$n.kib" \
       && { cat /proc/meminfo; ps -eo pid,rss,vsz,comm --sort=-rss | head -12; } > "$OUT/node_meminfo_$n.txt"; done) & sampler=$!
    timeout ${RUN_TIMEOUT:-900} python3 -m torch.distributed.run --nproc-per-node $n --standalone examples/finetune_8b.py --nvme-dir /var/tmp/ts-8b \
      --steps ${STEPS:-3} ${FT_ARGS:-} 2>&1 | tr '\r' '\n' > "$OUT/ranks_$n.log" || status=$(( status ? status : $? ))
    kill $sampler
    grep -E "^step [0-9]+/[0-9]+: loss|^model:|Error|error" "$OUT/ranks_$n.log" | sed "s/^/$n GPUs: /"
    echo "$n GPUs: the node's peak memory in use $(awk '{printf "%.1f", $1/2^20}' "$OUT/node_mem_$n.kib") GiB (sampled each second)"
    rm -rf /var/tmp/ts-8b/*
  done
  # the several-process tests over NCCL, one GPU per rank (the 3-rank ones where there are 3 GPUs)
  [[ -n ${NO_RANKS_TESTS:-} ]] && exit $status
  RANKS_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-1200} python3 -m pytest -v -p no:cacheprovider -m "slow or not slow" tests/integration/test_ranks.py \
    tests/integration/test_ranks_checkpoint.py tests/integration/test_hf_trainer_ranks.py \
    tests/integration/test_ranks_reads.py 2>&1 | tee "$OUT/ranks_tests.log" | tail -15 || status=$(( status ? status : $? ))
fi
if [[ $what == quality ]]; then  # issue 43: held-out loss of each moment_dtype beside the 8-bit baselines, one call
  # writes quality.json, quality.log and (where matplotlib is installed) quality.png; QARGS: e.g. "--host" or a shape
  plot=$(python3 -c "import matplotlib" 2>/dev/null && echo "--plot $OUT/quality.png")
  python3 examples/moment_quality.py --rows ${QROWS:-ts-fp32,ts-bf16,ts-int8,torch-fp32,bnb-8bit,torchao-8bit} \
    --steps ${QSTEPS:-1000} --json "$OUT/quality.json" $plot ${QARGS:-} 2>&1 | tee "$OUT/quality.log" \
    | grep -vE "^\s|^Traceback" | tail -40
  status=$(( status ? status : ${PIPESTATUS[0]} ))
fi
if [[ $what == bf16 ]]; then  # branch h-bf16arith (bf16's own arithmetic), one call: its GPU tests, whether CUDA's fp32
  # sqrt is correctly rounded, the CPU AdamW table (kernel and torch ops), then the quality rows ts-fp32 and ts-bf16
  TIERSTORE_FAILURES_NOW=1 python3 -m pytest -v --tb=short -m gpu -s -p no:cacheprovider tests/unit/runtime/update/test_moments_update.py \
    tests/unit/runtime/update/test_moments_rounding.py tests/unit/runtime/update/test_moments_kernel_bf16.py \
    tests/integration/test_compact_moments_gpu.py tests/integration/test_moment_kernel_training.py 2>&1 | tee "$OUT/bf16_tests.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -30 || status=$(( status ? status : $? ))
  python3 -c "import torch, numpy as np; x = torch.rand(1 << 24) * torch.exp(torch.randn(1 << 24) * 20); x[:1000] *= 1e-38; print('CUDA fp32 sqrt correctly rounded:', torch.equal(torch.sqrt(x.cuda()).cpu(), torch.from_numpy(np.sqrt(x.numpy()))))"
  python3 -m runtime.bench.adam_bench --threads 16 2>&1 | grep -v INFO | tee "$OUT/adam_bench.log"
  python3 -m runtime.bench.adam_bench --threads 16 --no-kernel --moment-dtype fp32 --moment-dtype bf16 2>&1 | grep -v INFO | tee -a "$OUT/adam_bench.log"
  QROWS=${QROWS:-ts-fp32,ts-bf16} bash "$0" quality || status=$(( status ? status : $? ))
fi
if [[ $what == session || $what == all ]]; then
  python3 -m runtime.bench.session_bench --out "$OUT" --steps ${STEPS:-6} 2>&1 | tee "$OUT/session_bench.log" | tail -40
  python3 -m runtime.bench.profiler_bench --row host-s40-keep --preset 1.35b --seq-len 1024 --batch-size 8 --steps 8 --rounds 3 2>&1 | tee "$OUT/profiler_overhead.log" | tail -12
fi
exit $status
