#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one call, on a machine with a CUDA GPU and CuPy, from the
# repository root, with no pip install of the project (no package index needed):
#
#     bash scripts/gpu_suite.sh
#
# Logs go to $OUT when set (else ./gpu_suite_logs): gpu_env.log, gpu_warm.log (the modules compiled first), gpu_tests.log, gpu_tests_K.xml/.log and gpu_shard_K.txt (a shard each),
# bench_kernels_gpu.log/.md, bench_gpu_tier.log/.md, bench_serve.log. The last thing printed is the summary table.
# Exit status: 0 when the GPU tests ran (not all skipped) and passed, else 1; the benchmarks never fail it.
# SKIP_KERNEL_BENCH=1 leaves out the kernel benchmark (its table is in docs/performance.md already);
# SKIP_BENCH=1 runs the tests alone (a shard then gets 540 s, else 420: GPU_TEST_TIMEOUT); SKIP_SERVE_BENCH=1 the serving benchmark, SKIP_SAMPLE_BENCH=1 the sampled pick's, SKIP_SPEC_BENCH=1 the --spec one, SKIP_BUS_BENCH=1 the bus rates'.
set -u
cd "$(dirname "$0")/.." || exit 2
# The machine reaches no package index: what it lacks travels as wheels in .whl/ (device README): gguf,
# and for tests/engine/test_serve.py (its GPU-tier test) fastapi, starlette, pydantic, pydantic_core, annotated-types,
# annotated-doc, typing-inspection, typing_extensions, opentelemetry-api, uvicorn, openai, jiter, distro, sniffio,
# httpx2, httpcore2, truststore (cp312 manylinux wheels of the versions pip installed here; 2026-12-01: 6 MB).
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD; fi
LOG=${OUT:-$PWD/gpu_suite_logs}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1

# The import names are namespaced (strata.engine -> engine/, ...): map them onto this checkout.
BOOT=$(mktemp -d)
python3 scripts/_dev_path.py "$BOOT" >/dev/null || { echo "gpu_suite: could not write the import bootstrap"; exit 2; }
export PYTHONPATH="$BOOT${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "== environment"
    nvidia-smi -L 2>&1
    python3 -c "import sys, numpy, numba; print('python', sys.version.split()[0], '| numpy', numpy.__version__, '| numba', numba.__version__)"
    python3 -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1
    python3 -c "from strata.engine.kernels import gpu; print('gpu.available():', gpu.available())" 2>&1 | tail -1
} 2>&1 | tee "$LOG/gpu_env.log"

# Only the files that hold GPU tests are collected: other test files need packages (torch,
# transformers, gguf) this machine may not have, and a collection error would mask the result.
# (a test is a GPU test when marked gpu, or when it takes the `rt` fixture of tests/conftest.py)
FILES=$(grep -lE "pytest.mark.gpu|def test_[a-z0-9_]+\([^)]*\brt\b" $(find tests -name "test_*.py" | sort))
echo "== GPU tests: $(echo $FILES)"
# In GPU_TEST_SHARDS pytest processes at once (default 4): one process no longer fits a 10-minute
# call (2026-12-02: the module compiles -- every block type builds mm, mmq, mmx and mmqx -- took
# most of 420 s and the selection was cut), and NVRTC compiles on one core a process. The tests go
# to the shards a test function at a time, by count, the heaviest by their seconds (scripts/gpu_shards.py says why).
SHARDS=${GPU_TEST_SHARDS:-4}
# Every module compiled first, side by side, into CuPy's disk cache, which the shards' processes then
# load (scripts/gpu_warm_kernels.py says why: the kernel tests' shard compiled ~25 modules one by one)
echo "== GPU kernel modules compiled into the disk cache"
timeout ${WARM_TIMEOUT:-240} python3 scripts/gpu_warm_kernels.py > "$LOG/gpu_warm.log" 2>&1 || echo "the warm-up failed or was cut (rc $?): the shards compile what it left out"
grep -E "FAILED|modules in|no GPU" "$LOG/gpu_warm.log"
rm -f "$LOG"/gpu_tests*.xml "$LOG"/gpu_tests_*.log "$LOG"/gpu_shard_*.txt
# (counted by test function: a node id cut at its parameters; gpu_shards.py deals the functions)
python3 -m pytest -m gpu -q -p no:cacheprovider --collect-only $FILES 2>/dev/null | grep "::" | sed -E 's/\[.*$//' | sort | uniq -c > "$LOG/gpu_collected.txt"
python3 scripts/gpu_shards.py "$SHARDS" "$LOG" $FILES || exit 2
# a shard's time limit: what is left of 450 s with the benchmarks after them, of 570 s (most of a
# 600 s call) alone, after the install, the environment lines, the modules' compile and the collection
TEST_LIMIT=${GPU_TEST_TIMEOUT:-$(( $([ -n "${SKIP_BENCH:-}" ] && echo 570 || echo 450) - SECONDS ))}
PIDS=""
for k in $(seq 0 $((SHARDS - 1))); do
    files=$(cat "$LOG/gpu_shard_$k.txt" 2>/dev/null)
    [ -n "$files" ] || continue
    echo "shard $k: $(echo $files | wc -w) test functions of $(echo $files | tr ' ' '\n' | cut -d: -f1 | sort -u | tr '\n' ' ')"
    timeout $TEST_LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
        --junitxml="$LOG/gpu_tests_$k.xml" $files > "$LOG/gpu_tests_$k.log" 2>&1 &
    PIDS="$PIDS $!"
done
TEST_RC=0
for pid in $PIDS; do wait $pid; rc=$?; [ $rc -eq 0 ] || TEST_RC=$rc; done
for k in $(seq 0 $((SHARDS - 1))); do [ -f "$LOG/gpu_tests_$k.log" ] && { echo "-- shard $k"; tail -25 "$LOG/gpu_tests_$k.log"; }; done | tee "$LOG/gpu_tests.log"
[ -n "${SKIP_BENCH:-}" ] && exec python3 scripts/gpu_suite_summary.py "$LOG" "$TEST_RC" skipped

if [ -z "${SKIP_SERVE_BENCH:-}" ]; then
    # strata serve's batch slots on the GPU tier: aggregate tok/s and time to first token at 1-8
    # streams, on the demo pack (synthesized in seconds; seed-4l's 5 GB would take the call's time)
    echo "== GPU benchmark: benchmarks/serve_streams.py (the demo pack, --device gpu)"
    timeout ${SERVE_BENCH_TIMEOUT:-240} bash -c 'python3 -c "import sys; from strata.tools.pack_cli import main; sys.exit(main())" demo -o /tmp/demo-pack --no-generate >/dev/null &&
        python3 benchmarks/serve_streams.py /tmp/demo-pack --device gpu --streams 1,2,4,8 --prompt 32 --tokens 32 --rounds 2 --threads 8' 2>&1 | tee "$LOG/bench_serve.log"
    # ... and strata serve --gpu-step device --spec 2: each stream in a session the tier placed, the
    # drafts (right with probability 0.43, always) verified per request and with --batch-mtp
    echo "== GPU benchmark: benchmarks/serve_streams.py (the demo pack, --gpu-step device --spec 2)"
    timeout ${SERVE_SPEC_BENCH_TIMEOUT:-150} python3 benchmarks/serve_streams.py /tmp/demo-pack --device gpu --gpu-step device \
        --streams 1,2,4 --prompt 32 --tokens 32 --rounds 2 --threads 8 --spec 2 --drafters right:0.43,oracle \
        --verify batch,slot 2>&1 | tee "$LOG/bench_serve_spec.log"
fi

echo "== GPU benchmark: benchmarks/gpu_tier.py (seed-4l: synthesized and packed on first use)"
# A device call is 10 minutes. On a fresh machine every kernel compiles first (the tests took 6 of
# them on 2026-11-30 with the panel kernels), so the benchmark gets what is left of SUITE_SECONDS:
# cut short, its table is missing and the summary says so (the tests decide the exit status).
LEFT=$(( ${SUITE_SECONDS:-570} - SECONDS ))
timeout ${TIER_BENCH_TIMEOUT:-$(( LEFT > 60 ? LEFT : 60 ))} python3 benchmarks/gpu_tier.py --threads ${TIER_THREADS:-8} --md "$LOG/bench_gpu_tier.md" 2>&1 | tee "$LOG/bench_gpu_tier.log"
BENCH_RC=${PIPESTATUS[0]}

if [ -z "${SKIP_SAMPLE_BENCH:-}" ]; then
    # the device step's sampled pick (dev_sample) against the logits brought down and the host's sampler
    echo "== GPU benchmark: benchmarks/device_sample.py"
    timeout 90 python3 benchmarks/device_sample.py 2>&1 | tee "$LOG/bench_device_sample.log"
fi

if [ -z "${SKIP_SPEC_BENCH:-}" ]; then
    # --spec N on the device step: a verify of 1 + N rows against a token step, and the speed-up at
    # acceptance 0.43 / 0.7 / 1 (seed-4l qwen35moe, synthesized by the tier benchmark above); 160
    # tokens: over 48 a session's eager and captured first forwards were ~15% of a run (2026-12-05)
    echo "== GPU benchmark: benchmarks/spec.py --device-step"
    timeout ${SPEC_BENCH_TIMEOUT:-240} python3 benchmarks/spec.py --device-step --no-mtp --rounds 3 --tokens 160 --prompt 32 2>&1 | tee "$LOG/bench_spec.log"
    # where a verify's time goes (its graph's device time against the token step's, each kernel's),
    # and the device head's draft step against the CPU's: as the engine runs (mvf), then with the
    # few-row matrices' products on the one-row kernel's NT rows (STRATA_MVT_TOKENS=4; 2026-12-06,
    # an H100: a verify of 1+2 rows 1.111 ms of device time with them, 1.087 without), then mmq as
    # before mvf (2026-12-05, an H100: 1.57 ms on mmq, 0.86 on mvf). The demo qwen35moe with an MTP
    # block; each with its run-ahead table (verifies queued as strata generate queues them).
    for kind in default nt mmq; do
        case $kind in default) E="STRATA_MVT_TOKENS=1";; nt) E="STRATA_MVT_TOKENS=4";; mmq) E="STRATA_MVT_TOKENS=1 STRATA_MVF_TOKENS=1";; esac
        echo "== GPU benchmark: benchmarks/verify_profile.py, $E"
        env $E timeout 150 python3 benchmarks/verify_profile.py 2>&1 | tee "$LOG/bench_verify_$kind.log"
    done
    # seed-4l qwen35moe's verify (spec.py's pack): its graph against the token step's, and run ahead
    P4=.cache/bench/seed-4l-qwen35moe-pack
    [ -d $P4 ] && echo "== GPU benchmark: benchmarks/verify_profile.py --pack $P4" && \
        timeout 90 python3 benchmarks/verify_profile.py --pack $P4 --host 0 --kernels 0 2>&1 | tee "$LOG/bench_verify4.log"
    # and each kernel's own device time in both (ncu), the verify's extra time by part
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    [ -d $P4 ] && [ -x "$NCU" ] && echo "== GPU benchmark: benchmarks/ncu_forward.py --pack $P4" && \
        timeout 120 python3 benchmarks/ncu_forward.py --pack $P4 --ncu "$NCU" 2>&1 | tee "$LOG/bench_ncu_forward.log"
fi

if [ -z "${SKIP_BUS_BENCH:-}" ]; then
    # how fast a layer's experts reach the card from the mapped GGUF (the layer stream's copy:
    # pageable, pinned through N threads, the bus, a registered mapping); seed-4l qwen4exp
    echo "== GPU benchmark: benchmarks/stream_bus.py"
    timeout 90 python3 benchmarks/stream_bus.py --threads 4,8 --layers 1 --repeat 2 2>&1 | tee "$LOG/bench_stream_bus.log"
fi

if [ -z "${SKIP_KERNEL_BENCH:-}" ]; then
    echo "== GPU benchmark: benchmarks/kernels_gpu.py"
    timeout 150 python3 benchmarks/kernels_gpu.py --md "$LOG/bench_kernels_gpu.md" 2>&1 | tee "$LOG/bench_kernels_gpu.log"
fi

python3 scripts/gpu_suite_summary.py "$LOG" "$TEST_RC" "$BENCH_RC"
