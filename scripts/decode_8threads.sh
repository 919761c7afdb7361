#!/bin/bash
# CPU decode at 8 threads on the device host: Strata (benchmarks/decode.py) and llama.cpp (llama-bench
# built with CUDA, run with -ngl 0 and the GPU hidden: CPU only), one after the other, on the same
# synthesized seed-4l GGUF. The device reaches no network: fetch llama.cpp's source here first and
# carry .peer (and .whl) to it:
#     bash ../shared/peer/fetch_llama_cpp.sh .peer/llama.cpp && cp ../shared/peer/build_llama_cuda.sh .peer/
#     (device) BUILD_SCRIPT=.peer/build_llama_cuda.sh bash scripts/decode_8threads.sh
# ARCH=qwen35moe measures the qwen35moe of the same geometry instead (K-quant mix; its GGUF is
# synthesized there too: ~6.5 GB, about a minute). THREADS (default "8 1") lists llama-bench's runs.
# AB=1 also runs benchmarks/decode_ab.py at 8 threads: the token path with and without its latest
# change (decode_ab.py's docstring names it), same process, interleaved.
cd "$(dirname "$0")/.."
bash ${BUILD_SCRIPT:-../shared/peer/build_llama_cuda.sh} .peer/llama.cpp /tmp/llama-build
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; fi
python3 scripts/_dev_path.py /tmp/boot >/dev/null
export PYTHONPATH=/tmp/boot:/tmp/site
lscpu | grep -E "Model name|^CPU\(s\)"
t0=$SECONDS
ARCH=${ARCH:-qwen4exp}
timeout 330 python3 benchmarks/decode.py --arch $ARCH --threads 8 --tokens 32 --rounds 2 2>&1 | grep -v compiling | tail -25
echo "strata done at $((SECONDS - t0)) s"
if [ -n "$AB" ]; then timeout 300 python3 benchmarks/decode_ab.py --arch $ARCH --threads 8 --rounds 3 2>&1 | grep -v compiling | tail -13; fi
for i in $(seq 1 60); do test -f /tmp/llama-build/done && break; sleep 5; done
echo "llama build: $(cat /tmp/llama-build/done 2>/dev/null) after $((SECONDS - t0)) s"
G=$(ls .cache/bench/seed-4l-$ARCH-00001-of-00002.gguf)
for t in ${THREADS:-8 1}; do CUDA_VISIBLE_DEVICES= timeout 120 /tmp/llama-build/bin/llama-bench -m $G -ngl 0 -t $t -p 0 -n 32 -r 3 2>&1 | tail -4; done
