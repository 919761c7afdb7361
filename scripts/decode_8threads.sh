#!/bin/bash
# The CPU engine beside llama.cpp on a many-core host (the device's: 16 cores), in one call:
#   - llama-bench built there for its CPU alone (-DGGML_NATIVE=ON, no CUDA: ~2 minutes on 16 cores,
#     in the background while the models are synthesized and the kernels compiled: on a fresh
#     machine the two took ~320 s together, 2026-12-05);
#   then the PARTS asked for (default "decode spec"; all of them do not fit one 10-minute call):
#   - decode: at 8 threads, ROUNDS rounds (default 3) of llama-bench tg32 then Strata for each of
#     ARCHS (default qwen4exp qwen35moe), interleaved, so a slow spell of the host falls on both;
#     Strata's side is benchmarks/switch_ab.py (Model.step, 24 tokens after 8, median), the default
#     against SIDE: by default "-", a second process of the same settings, so the table shows how far
#     two runs of one engine move apart (the noise a ratio is read against); a switch to measure, as
#     SIDE=STRATA_MAIN_ORCHESTRATES=1 (session 30: 0.95-1.01x at 8 threads). Then 1 and 2 threads,
#     one round each;
#   - spec: what verifying 1 + N rows costs against a token step at 8 threads (benchmarks/spec.py --cost-only);
#   - sweep: benchmarks/decode.py --sweep 1,2,8 (each stage's time at each count, one process);
#   - launches: qwen4exp's 8-thread token launch by launch (benchmarks/token_launches.py);
#   - prompt: at PROMPT_THREADS (default 8), 512 and 4096 tokens: llama-bench pp, then
#     benchmarks/prefill.py --sweep (qwen4exp).
# The figures are ratios within one call: machines of one kind differ by up to 1.7x at one thread
# (docs/performance.md, session 24), and one machine's llama-bench tg32 moved 33-44 tok/s between
# rounds minutes apart (session 30). llama_cpp is not importable there, so the peer is llama-bench.
# The device reaches no network: fetch llama.cpp's source here first and carry .peer (and .whl) to it:
#     bash ../shared/peer/fetch_llama_cpp.sh .peer/llama.cpp
#     (device) bash scripts/decode_8threads.sh                  # PARTS="prompt" bash ... for the prompt
# Everything it prints also goes to $OUT/decode_8threads.log when OUT is set (the device's folder
# that comes back): a call that runs past its limit returns only what is under $OUT, and a run piped
# through `tail` prints nothing before it ends (session 25 lost a call's ~600 s that way).
cd "$(dirname "$0")/.."
if [ -n "$OUT" ]; then exec > >(tee "$OUT/decode_8threads.log") 2>&1; fi
PARTS=" ${PARTS:-decode spec} "
ARCHS=${ARCHS:-qwen4exp qwen35moe}
ROUNDS=${ROUNDS:-3}
SIDE=${SIDE:--}
PROMPT_THREADS=${PROMPT_THREADS:-8}
B=/tmp/llama-cpu
if [ ! -x $B/bin/llama-bench ]; then  # (a warm machine keeps the last call's build)
    mkdir -p $B
    rm -f $B/done
    (cmake -S .peer/llama.cpp -B $B -G Ninja -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF > $B/configure.log 2>&1 \
        && cmake --build $B --target llama-bench -j "$(nproc)" > $B/build.log 2>&1; echo $? > $B/done) &
fi
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
if [[ $PARTS == *" decode "* && $SIDE != "-" ]]; then  # a switch's kernels may compile into their own cache files: once, untimed
    env ${SIDE//,/ } timeout 150 python3 benchmarks/decode.py --arch qwen4exp --threads 8 --tokens 2 --rounds 0 --no-pretouch 2>&1 | grep -E "^loaded"
fi
for i in $(seq 1 100); do test -x $B/bin/llama-bench && break; sleep 3; done
echo "models, kernels and llama-bench ready at $((SECONDS - t0)) s"
lb() { timeout 150 $B/bin/llama-bench -m "$(ls .cache/bench/seed-4l-$1-00001-of-0000*.gguf)" -ngl 0 "${@:2}" 2>&1 | grep -E "tg32|pp"; }
ab() { timeout 150 python3 benchmarks/switch_ab.py - "$SIDE" --arch "$@" 2>&1 | grep -E "^\| (threads|[0-9])|logits"; }
if [[ $PARTS == *" decode "* ]]; then
    for r in $(seq 1 $ROUNDS); do
        for A in $ARCHS; do
            echo "== decode, 8 threads, round $r, $A, at $((SECONDS - t0)) s"
            lb $A -t 8 -p 0 -n 32 -r 3
            ab $A --threads 8 --rounds 1 --tokens 24
        done
    done
    for A in $ARCHS; do
        echo "== decode, 1 and 2 threads, $A, at $((SECONDS - t0)) s"
        lb $A -t 1,2 -p 0 -n 32 -r 2
        ab $A --threads 1,2 --rounds 1 --tokens 16
    done
fi
if [[ $PARTS == *" spec "* ]]; then  # speculative decoding's verify forward against the token step
    echo "== verify cost, 8 threads, at $((SECONDS - t0)) s"
    timeout 120 python3 benchmarks/spec.py --cost-only --threads 8 --rounds 5 --no-mtp 2>&1 | tail -5
fi
if [[ $PARTS == *" sweep "* ]]; then
    for A in $ARCHS; do timeout 150 python3 benchmarks/decode.py --arch $A --threads 8 --tokens 16 --sweep 1,2,8 2>&1 | grep -v -i compil | tail -13; done
fi
if [[ $PARTS == *" launches "* ]]; then  # the time between launches is host work
    timeout 120 python3 benchmarks/token_launches.py --arch qwen4exp --threads 8 --tokens 12 --top 24 2>&1 | tail -30
fi
if [[ $PARTS == *" prompt "* ]]; then
    lb qwen4exp -t $PROMPT_THREADS -p 512,4096 -n 0 -r 2
    for L in 512 4096; do
        timeout 150 python3 benchmarks/prefill.py --threads $PROMPT_THREADS --lengths $L --sweep $PROMPT_THREADS 2>&1 | grep -v -i compil | tail -12
    done
fi
echo "done at $((SECONDS - t0)) s"
