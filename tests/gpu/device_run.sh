#!/usr/bin/env bash
# The one script for the device machine (2 GPUs; on 4, the world-3/4 tests run on NCCL and the
# benchmarks take --world 4 in BENCH_ARGS): GPU tests, then the benchmark.
# Usage: bash tests/gpu/device_run.sh OUTDIR [x2_first|tests|shared|cpu|bench|host|host_shared|watchdog|float8|costmodel|plan|attention|attention1|e2e|e2e_shapes|torchtitan|moe|moe_pieces|fused_probe|moe_sync_free|moe_graph|decode|decode_step|decode_step_shared|flex|flex_probe|flex_bench|flex_pulled|meshslice|all] [pytest -k expression]
# (BENCH_ARGS, e.g. "--commit abc1234", goes to the benchmarks: the device copy's git metadata
# can be stale, so pass the commit explicitly.)
# The whole GPU suite takes ~9-10 min on 2x H200, more than one device call may run: split it,
# e.g. `... tests "not test_nccl_reference"` (~5 min) then `... tests test_nccl_reference` (~1 min)
# ("not nccl" would also drop test_every_gpu_schedule_matches_reference_and_nccl).
set -uo pipefail
out=${1:?output dir}; what=${2:-all}; sel=${3:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# A test that runs long fails on its own bound (pytest-timeout), with its traceback and the run's
# summary, instead of the call's outer `timeout` killing pytest before either is written.
GPU_PYTEST="-v -p no:cacheprovider --timeout ${PER_TEST_TIMEOUT:-300} --tb=short -rfE --durations=10"
mkdir -p "$out"
nvidia-smi topo -m > "$out/topo.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'GPUs')"
python3 -m benchmarks.gpu_health 2>&1 | tee "$out/health.txt"  # a sick machine makes every timing useless
if [[ $what == x2_first ]]; then
  # issue 72's first call on two GPUs (~8 min): the fused sm_90a kernels and the GPU schedules
  # across two real GPUs (NCCL, peer stores over NVLink; shared mode only ever ran them on one),
  # then each region call's host time of record (bench_host), then training at 4 x 2048 with the
  # comm-free bound and the step's picture; the other e2e shapes, torchtitan, MoE, decode and
  # flex are calls of their own (docs/benchmarking.md, "Two GPUs")
  sel=${sel:-"sm90 or every_gpu_schedule or back_to_back_calls_do_not_corrupt"}
  TEST_TIMEOUT=${TEST_TIMEOUT:-200} BENCH_TIMEOUT=${BENCH_TIMEOUT:-130}
  E2E_SHAPES=${E2E_SHAPES:-4x2048} E2E_TIMEOUT=${E2E_TIMEOUT:-170}
fi
if [[ $what == tests || $what == all || $what == x2_first ]]; then
  # Bounded waits during the tests: a protocol bug fails a test instead of hanging the run.
  TORCH_COMMOPT_DEBUG_WAITS=${DEBUG_WAITS:-1} TORCH_COMMOPT_WAIT_TIMEOUT_S=${WAIT_TIMEOUT_S:-60} \
    timeout ${TEST_TIMEOUT:-480} python3 -m pytest $GPU_PYTEST tests/gpu ${sel:+-k "$sel"} 2>&1 | tee "$out/gpu_tests.log"
fi
if [[ $what == shared ]]; then
  # One GPU, two ranks sharing it over gloo (torch_commopt/kernels/gpu/shared_device.py): every
  # two-rank GPU test's numerics and flag protocol on a one-GPU machine; no timing, no NCCL.
  # The whole suite needs ~9 min this way (one H200: 96 of 100 tests in the 520 s limit), more
  # than one call leaves after start-up: split it, e.g. `... shared "not
  # worlds_3_and_4 and not per_call_graphs"` then `... shared "worlds_3_and_4 or per_call_graphs"`.
  TORCH_COMMOPT_SHARED_DEVICE=1 TORCH_COMMOPT_DEBUG_WAITS=${DEBUG_WAITS:-1} TORCH_COMMOPT_WAIT_TIMEOUT_S=${WAIT_TIMEOUT_S:-60} \
    timeout ${TEST_TIMEOUT:-540} python3 -m pytest $GPU_PYTEST tests/gpu ${sel:+-k "$sel"} 2>&1 | tee "$out/gpu_tests_shared.log"
fi
if [[ $what == host || $what == x2_first ]]; then
  # issue 67: replayed host traces against the Python host code (numerics, bit equality), then each
  # region call's host time at the training step's shapes (benchmarks/bench_host.py, ~1 min)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_host_replay_gpu.py 2>&1 | tee "$out/host_replay_tests.log"
  timeout ${BENCH_TIMEOUT:-240} python3 -m benchmarks.bench_host --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/host_bench.log"
fi
if [[ $what == watchdog ]]; then
  # issue 66: a stuck peer bounded by the watchdog (production waits), then its cost on vs off;
  # on one GPU with TORCH_COMMOPT_SHARED_DEVICE=1 (both ranks share it)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_watchdog_gpu.py 2>&1 | tee "$out/watchdog_tests.log"
  timeout ${BENCH_TIMEOUT:-400} python3 -m benchmarks.bench_watchdog --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/watchdog_bench.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_matmul_collectives --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
fi
if [[ $what == plan ]]; then
  # the whole-graph plan figure: a compiled TP+SP block, searched plan vs fixed per-region plans
  timeout ${PLAN_TIMEOUT:-420} python3 -m benchmarks.bench_plan --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/plan.log"
fi
if [[ $what == attention ]]; then
  # context-parallel attention (issue 6): commopt schedules vs one GPU and torch CP; ~8 min default
  # sweep (BENCH_ARGS may add --full, --seq ..., --passes ...; partial.jsonl keeps a cut-short run;
  # python3 -m benchmarks.render_attention joins runs).  S_total 256K on 80 GB cards: torch CP's
  # backward ring needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  mkdir -p "$out/attention"
  timeout ${ATTN_TIMEOUT:-560} python3 -m benchmarks.bench_attention --out "$out/attention" ${BENCH_ARGS:-} 2>&1 | tee "$out/attention.log"
fi
if [[ $what == e2e ]]; then
  # issue 7: a few Llama-3-8B layers trained with inductor, inductor + async-TP and commopt
  timeout ${E2E_TIMEOUT:-560} python3 -m benchmarks.bench_e2e --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/e2e.log"
fi
if [[ $what == e2e_shapes || $what == x2_first ]]; then
  # issue 7 at three shapes of 8192 tokens a step (batch x seq: 1 x 8192, 2 x 4096, 4 x 2048; or
  # E2E_SHAPES, e.g. "4x2048"), each with the comm-free bound; batch > 1 gathers and scatters
  # strided row blocks; ~100 s each
  # (E2E_VARIANTS replaces the variant list, e.g. "inductor,commopt,commopt call-graphs all,inductor comm-free");
  # each report carries the picture of one commopt and one inductor step (--timeline; TIMELINE_BATCHES
  # names the batches that draw one, default all three); its traces are dropped but the profiled
  # steps' of both ranks (OUT/e2e_bB_traces.tgz)
  for shp in ${E2E_SHAPES:-1x8192 2x4096 4x2048}; do
    set -- ${shp/x/ }
    mkdir -p "$out/e2e_b$1"
    tl=--timeline; [[ " ${TIMELINE_BATCHES:-1 2 4} " == *" $1 "* ]] || tl=
    timeout ${E2E_TIMEOUT:-160} python3 -m benchmarks.bench_e2e --out "$out/e2e_b$1" --batch $1 --seq $2 --repeats 10 \
      $tl --variants "${E2E_VARIANTS:-inductor,inductor+async-TP,commopt,inductor comm-free}" ${BENCH_ARGS:-} \
      > "$out/e2e_b$1.log" 2>&1
    # both ranks' sustained traces (the profiled steps, device and launch calls only), compressed
    # for a closer look than the report's (a few hundred KB a batch); the rest of the traces dropped
    # (E2E_HOST_TRACES=1: commopt's and inductor's traced steps with their host ops too, for
    # where the host's enqueue time goes; a few MB more a batch)
    host=; [[ ${E2E_HOST_TRACES:-0} == 1 ]] && host=$(cd "$out/e2e_b$1" && ls traces/commopt_rank*.json traces/inductor_rank*.json 2> /dev/null)
    (cd "$out/e2e_b$1" && ls traces/*_sustained_rank*.json > /dev/null 2>&1 \
      && tar czf "../e2e_b$1_traces.tgz" traces/*_sustained_rank*.json $host)
    rm -rf "$out/e2e_b$1/traces"
    echo "== batch $1 seq $2"; grep -E "^\| (ind|com)" "$out/e2e_b$1.log"
  done
fi
if [[ $what == torchtitan ]]; then
  # issue 7: torchtitan 0.2.2 trained with commopt and with inductor; its wheels and the missing
  # dependencies are carried in .whl/ (list: torch_commopt/integrations/torchtitan/__init__.py)
  ttsite=$(mktemp -d)  # a fresh directory, not a fixed shared path
  python3 -m pip install -q --no-deps --target "$ttsite" .whl/*.whl > "$out/tt_install.log" 2>&1
  # TT_EXTRA: torchtitan arguments for every job, kept whole (BENCH_ARGS is split on spaces, so
  # an --extra there holds one argument), e.g. TT_EXTRA="--optimizer.lr=3e-4 --metrics.log_freq=10"
  PYTHONPATH=$ttsite:$PYTHONPATH timeout ${TT_TIMEOUT:-560} python3 -m benchmarks.bench_torchtitan --out "$out" \
    ${BENCH_ARGS:-} ${TT_EXTRA:+"--extra=$TT_EXTRA"} 2>&1 | tee "$out/torchtitan.log"
  # --profile-step's Chrome traces of every rank (benchmarks/tt_profile.py), compressed
  if [[ -d $out/tt_traces ]]; then (cd "$out" && tar czf tt_traces.tgz tt_traces && rm -rf tt_traces); fi
fi
if [[ $what == host_shared ]]; then
  # issue 67, one GPU: the replayed host traces with both ranks on it (numerics, bit equality; the
  # sm_90a fused cases among them), then each region call's host time (bench_host --shared: the
  # host's cost is real, the GPU's time-sliced), ~3 min
  TORCH_COMMOPT_SHARED_DEVICE=1 timeout ${TEST_TIMEOUT:-300} python3 -m pytest $GPU_PYTEST tests/gpu/test_host_replay_gpu.py 2>&1 | tee "$out/host_replay_tests_shared.log"
  timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks.bench_host --shared --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/host_bench.log"
fi
if [[ $what == fused_probe ]]; then
  # issue 67, one GPU: the fused kernels' one-GPU tests (flags raised beforehand), then their GEMM
  # throughput against cuBLAS at the training step's shapes over a sweep of tiles, then back to back (~3 min)
  timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_gemm_one_gpu.py tests/gpu/test_sm90_gemm.py 2>&1 | tee "$out/fused_tests.log"
  timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks.probe_fused_gemm --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/fused_probe.log"
fi
if [[ $what == moe_pieces ]]; then
  # issue 68, one GPU: the experts' grouped GEMMs whole vs in pieces by source (what by_peer costs the compute)
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_moe --pieces --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/moe_pieces.log"
fi
if [[ $what == moe_sync_free ]]; then
  # issue 68, 2 GPUs: the MoE GPU tests (sync_free among them: no host read after its first call,
  # under torch.cuda.set_sync_debug_mode), then one layer at few tokens a rank, torchtitan's EP vs
  # a2a vs sync_free vs the comm-free bound (SYNC_FREE_TOKENS; BENCH_ARGS e.g. "--commit abc");
  # torchtitan 0.2.2 carried in .whl/
  TORCH_COMMOPT_DEBUG_WAITS=1 TORCH_COMMOPT_WAIT_TIMEOUT_S=60 timeout ${TEST_TIMEOUT:-200} \
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py 2>&1 | tee "$out/gpu_moe.log"
  ttsite=$(mktemp -d)
  python3 -m pip install -q --no-deps --target "$ttsite" .whl/*.whl > "$out/tt_install.log" 2>&1
  PYTHONPATH=$ttsite:$PYTHONPATH timeout ${BENCH_TIMEOUT:-240} python3 -m benchmarks.bench_moe --out "$out" \
    --models dsv2-lite qwen3-30b-a3b --tokens ${SYNC_FREE_TOKENS:-256 1024 4096} --routings balanced \
    --variants a2a sync_free --rounds 5 ${BENCH_ARGS:-} 2>&1 | tee "$out/moe.log"
fi
if [[ $what == moe_graph ]]; then
  # issue 68, 2 GPUs: one MoE layer's forward at decoding sizes (8, 64, 512 tokens a rank), eager
  # (torchtitan's EP, a2a, sync_free) and sync_free's replayed from a CUDA graph, with each
  # variant's host syncs (BENCH_ARGS e.g. "--commit abc"); torchtitan 0.2.2 carried in .whl/
  ttsite=$(mktemp -d)
  python3 -m pip install -q --no-deps --target "$ttsite" .whl/*.whl > "$out/tt_install.log" 2>&1
  PYTHONPATH=$ttsite:$PYTHONPATH timeout ${BENCH_TIMEOUT:-400} python3 -m benchmarks.bench_moe --out "$out" --graph \
    --models dsv2-lite qwen3-30b-a3b --rounds 5 --steps 20 ${BENCH_ARGS:-} 2>&1 | tee "$out/moe_graph.log"
fi
if [[ $what == moe ]]; then
  # issue 68, W GPUs: the MoE GPU tests, then one MoE layer, torchtitan's EP vs commopt's schedules
  # vs the comm-free bound, the fine-grained models and Mixtral in two runs joined into one report
  # (~4 min on 2x H200 with BENCH_ARGS="--commit abc --variants a2a by_expert auto --rounds 5");
  # torchtitan 0.2.2 carried in .whl/ as for the torchtitan mode
  TORCH_COMMOPT_DEBUG_WAITS=1 TORCH_COMMOPT_WAIT_TIMEOUT_S=60 timeout ${TEST_TIMEOUT:-150} \
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py 2>&1 | tee "$out/gpu_moe.log"
  ttsite=$(mktemp -d)
  python3 -m pip install -q --no-deps --target "$ttsite" .whl/*.whl > "$out/tt_install.log" 2>&1
  for part in "dsv2-lite qwen3-30b-a3b" "mixtral-8x7b"; do
    PYTHONPATH=$ttsite:$PYTHONPATH timeout ${BENCH_TIMEOUT:-280} python3 -m benchmarks.bench_moe --out "$out/${part%% *}" \
      --models $part ${BENCH_ARGS:-} 2>&1 | tee -a "$out/moe.log"
  done
  python3 -m benchmarks.bench_moe --join "$out"/dsv2-lite/moe_*.json "$out"/mixtral-8x7b/moe_*.json --out "$out"
fi
if [[ $what == decode ]]; then
  # issue 69 (a), W GPUs: decode-sized GEMM + all-reduce, NCCL vs torch symm_mem vs oneshot/twoshot, from CUDA graphs
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_decode --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/decode.log"
fi
if [[ $what == decode_step ]]; then
  # issue 69 (b), W GPUs: a Llama-3-8B-shaped TP decoder step from CUDA graphs (inductor + NCCL,
  # inductor + torch symm_mem, commopt, the comm-free bound); BENCH_ARGS e.g. "--batch 1 --commit abc"
  # (a 32-layer case compiles every variant: split by batch to stay inside one call)
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_decode --step --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/decode_step.log"
fi
if [[ $what == decode_step_shared ]]; then
  # issue 69 (b), one GPU: the decoder step with both ranks on it (correctness: commopt vs the unsharded model)
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_decode --step --shared --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/decode_step_shared.log"
fi
if [[ $what == flex ]]; then
  # issue 70, one GPU: the FlexAttention CP GPU tests with both ranks on it (numerics of the ops and
  # of compiled programs), then each flex schedule's per-rank compute against the whole-sequence kernel
  TORCH_COMMOPT_SHARED_DEVICE=1 TORCH_COMMOPT_DEBUG_WAITS=1 TORCH_COMMOPT_WAIT_TIMEOUT_S=120 \
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest $GPU_PYTEST tests/gpu/test_flex_gpu.py ${sel:+-k "$sel"} 2>&1 | tee "$out/gpu_flex.log"
  timeout ${PROBE_TIMEOUT:-400} python3 -m benchmarks.probe_flex_blocks --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/flex_blocks.log"
fi
if [[ $what == flex_probe ]]; then
  # issue 70, one GPU: the probe alone (no tests), e.g. BENCH_ARGS="--seq 16384 --commit abc"
  timeout ${PROBE_TIMEOUT:-540} python3 -m benchmarks.probe_flex_blocks --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/flex_blocks.log"
fi
if [[ $what == flex_bench ]]; then
  # issue 70 on W GPUs: FlexAttention CP, commopt vs one GPU and torch's context_parallel.  Every
  # schedule and layout compiles kernels of its own: on 2x H200 not one case of "--seq 16384,32768"
  # ended in 240 s.  Give BENCH_ARGS "--pick-only" (commopt's pick on choose's layout, torch CP's two
  # balancers, the single GPU) and one S_total and a few masks a call, e.g. "--pick-only --seq 16384
  # --masks causal,docs_4K" ('_' for the space BENCH_ARGS would split on); with
  # TORCH_COMMOPT_ATTENTION_TRANSPORT=nccl exported, commopt's K/V move by NCCL, not the copy engine (a report of its own, _nccl)
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_flex --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/flex_bench.log"
fi
if [[ $what == flex_pulled ]]; then
  # issue 70, one GPU (both ranks on it): the pulled, cut K/V gather (TORCH_COMMOPT_FLEX_GATHER_CUT)
  # -- its numerics through the ops, then bench_flex's check of every variant beside the whole
  # gather, with each variant's host time a call and a cProfile of commopt's host work (times of two
  # ranks sharing one GPU are no figures: the report is not written in shared mode)
  TORCH_COMMOPT_SHARED_DEVICE=1 TORCH_COMMOPT_DEBUG_WAITS=1 TORCH_COMMOPT_WAIT_TIMEOUT_S=60 \
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest $GPU_PYTEST tests/gpu/test_flex_gpu.py -k "pulled_gather" 2>&1 \
    | tee "$out/gpu_flex_pulled.log"
  timeout ${BENCH_TIMEOUT:-400} python3 -m benchmarks.bench_flex --shared --pick-only --pulled --seq 16384 \
    --masks docs_1K --host 10 --host-profile 5 ${BENCH_ARGS:-} 2>&1 | tee "$out/flex_pulled_bench.log"
fi
if [[ $what == meshslice ]]; then
  # issue 71/73, 4 GPUs as a 2 x 2 mesh: the FC layers through the reference 2D GEMMs, Collective vs
  # MeshSlice vs SUMMA, beside the simulator's prediction (BENCH_ARGS e.g. "--commit abc --tokens 8192")
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_meshslice --measure --world 4 --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/meshslice.log"
fi
if [[ $what == attention1 ]]; then
  # one GPU: the CUDA local-attention backends vs math, and each schedule's compute alone per rank
  timeout 200 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_attention_local.py 2>&1 | tee "$out/gpu_attention_local.log"
  timeout ${PROBE_TIMEOUT:-380} python3 -m benchmarks.probe_attention_blocks "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/attention_blocks.log"
fi
if [[ $what == float8 ]]; then
  # float8 (_scaled_mm) regions: the GPU tests, then the kernels sweep with float8 operands (~2 min)
  TORCH_COMMOPT_DEBUG_WAITS=${DEBUG_WAITS:-1} TORCH_COMMOPT_WAIT_TIMEOUT_S=${WAIT_TIMEOUT_S:-60} \
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_float8_gpu.py 2>&1 | tee "$out/gpu_tests_float8.log"
  mkdir -p "$out/float8"
  timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks.bench_matmul_collectives --out "$out/float8" --dtype float8_e4m3fn \
    ${BENCH_ARGS:-} > "$out/float8.log" 2>&1; grep -oE '\[(eager|graph)\] .*' "$out/float8.log"
fi
if [[ $what == costmodel ]]; then
  # the tuner figures, eager and replayed from CUDA graphs (~1 min each)
  mkdir -p "$out/eager" "$out/graphs"
  timeout 240 python3 -m benchmarks.bench_costmodel --out "$out/eager" ${BENCH_ARGS:-} > "$out/costmodel_eager.log" 2>&1
  timeout 240 python3 -m benchmarks.bench_costmodel --out "$out/graphs" --cuda-graphs ${BENCH_ARGS:-} > "$out/costmodel_graphs.log" 2>&1
  tail -14 "$out/costmodel_eager.log"; tail -14 "$out/costmodel_graphs.log"
fi
if [[ $what == cpu ]]; then
  # The whole CPU suite, the slow tier included (make test-all), on this machine's torch (2.11:
  # the oldest we support), CUDA hidden, in CPU_SHARDS pytest-xdist workers (dealt one at a time,
  # as make test does).  The third
  # argument, if any, names the test paths (the whole suite needs more than one call there).
  export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=${CPU_THREADS:-1}
  timeout ${CPU_TIMEOUT:-560} python3 -m pytest -v -rfE -p no:cacheprovider -n ${CPU_SHARDS:-8} --dist load --durations=25 \
    ${sel:-tests} --ignore=tests/gpu > "$out/cpu_suite.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/cpu_suite.log" | tail -40
fi
