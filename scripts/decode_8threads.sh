#!/bin/bash
# The CPU engine beside llama.cpp on a many-core host (the device's: 16 cores), in one call:
#   - llama-bench built there for its CPU alone (-DGGML_NATIVE=ON, no CUDA: ~2 minutes on 16 cores,
#     in the background while the models are synthesized and the kernels compiled);
#   - decode at THREADS (default 1,2,8) for ARCHS (default qwen4exp qwen35moe): llama-bench tg32,
#     then benchmarks/decode.py --sweep (each stage's time at each count, one process);
#   - qwen4exp's 8-thread token launch by launch (benchmarks/token_launches.py);
#   - settings read at a process's start, at 8 threads, each side its own process, rotated
#     (benchmarks/switch_ab.py): the default against the token kernels' prefetch into L1 (the code
#     before 2026-12-04), OpenMP's threads bound to cores, and the main thread only orchestrating
#     (STRATA_MAIN_ORCHESTRATES=1: 7 streaming threads); then at 9 threads, 9 streaming against 8
#     and the orchestrating main thread;
#   - what verifying 1 + N rows costs against a token step at 8 threads (benchmarks/spec.py --cost-only);
#   - the prompt at PROMPT_THREADS (default 8), 512 and 4096 tokens: llama-bench pp, then
#     benchmarks/prefill.py --sweep (qwen4exp).
# llama.cpp runs first, then Strata: not interleaved (llama_cpp is not importable there). Machines of
# one kind differ by up to 1.7x at one thread (docs/performance.md, session 24): compare within a call.
# The device reaches no network: fetch llama.cpp's source here first and carry .peer (and .whl) to it:
#     bash ../shared/peer/fetch_llama_cpp.sh .peer/llama.cpp
#     (device) bash scripts/decode_8threads.sh
# Everything it prints also goes to $OUT/decode_8threads.log when OUT is set (the device's folder
# that comes back): a call that runs past its limit returns only what is under $OUT, and a run piped
# through `tail` prints nothing before it ends (session 25 lost a call's ~600 s that way).
cd "$(dirname "$0")/.."
if [ -n "$OUT" ]; then exec > >(tee "$OUT/decode_8threads.log") 2>&1; fi
THREADS=${THREADS:-1,2,8}
ARCHS=${ARCHS:-qwen4exp qwen35moe}
PROMPT_THREADS=${PROMPT_THREADS:-8}
B=/tmp/llama-cpu
mkdir -p $B
rm -f $B/done
(cmake -S .peer/llama.cpp -B $B -G Ninja -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF > $B/configure.log 2>&1 \
    && cmake --build $B --target llama-bench -j "$(nproc)" > $B/build.log 2>&1; echo $? > $B/done) &
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; fi
python3 scripts/_dev_path.py /tmp/boot >/dev/null
export PYTHONPATH=/tmp/boot:/tmp/site
lscpu | grep -E "Model name|^CPU\(s\)"
echo "SIMD: $(grep -o -w -E 'avx2|f16c|avx512f|avx512bw|avx512_vnni|avx_vnni|amx_tile|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')"
t0=$SECONDS
# the models made and the kernels compiled (into numba's disk cache) beside the build: nothing timed
prep=()
for A in $ARCHS; do (timeout 250 python3 benchmarks/decode.py --arch $A --threads 8 --tokens 2 --rounds 0 --no-pretouch 2>&1 | grep -E "^loaded") & prep+=($!); done
wait "${prep[@]}"
for i in $(seq 1 100); do test -f $B/done && break; sleep 3; done
echo "llama build: exit $(cat $B/done 2>/dev/null) at $((SECONDS - t0)) s"
lb() { timeout 150 $B/bin/llama-bench -m "$(ls .cache/bench/seed-4l-$1-00001-of-0000*.gguf)" -ngl 0 "${@:2}" 2>&1 | grep -E "tg32|pp"; }
for A in $ARCHS; do
    lb $A -t $THREADS -p 0 -n 32 -r 3
    timeout 150 python3 benchmarks/decode.py --arch $A --threads 8 --tokens 16 --sweep $THREADS 2>&1 | grep -v -i compil | tail -13
done
# where qwen4exp's 8-thread token goes, launch by launch (the time between launches is host work)
timeout 120 python3 benchmarks/token_launches.py --arch qwen4exp --threads 8 --tokens 12 --top 24 2>&1 | tail -30
timeout 300 python3 benchmarks/switch_ab.py - STRATA_ROWDOT_PREFETCH_CACHE=l1 OMP_PROC_BIND=close,OMP_PLACES=cores STRATA_MAIN_ORCHESTRATES=1 \
    --threads 8 --rounds 2 --tokens 24 2>&1 | tail -8  # (~8 processes: the l1 and orchestrated sides compile their kernels first)
# the main thread orchestrating beside 8 streaming threads (9 in all) against 9 streaming: read with
# the 8-thread default above (the same machine, minutes apart)
timeout 200 python3 benchmarks/switch_ab.py - STRATA_MAIN_ORCHESTRATES=1 --threads 9 --rounds 2 --tokens 24 2>&1 | tail -4
# speculative decoding's verify forward against the token step at 8 threads (issue 17's CPU figure)
timeout 120 python3 benchmarks/spec.py --cost-only --threads 8 --rounds 5 --no-mtp 2>&1 | tail -5
lb qwen4exp -t $PROMPT_THREADS -p 512,4096 -n 0 -r 2
for L in 512 4096; do
    timeout 150 python3 benchmarks/prefill.py --threads $PROMPT_THREADS --lengths $L --sweep $PROMPT_THREADS 2>&1 | grep -v -i compil | tail -12
done
echo "done at $((SECONDS - t0)) s"
