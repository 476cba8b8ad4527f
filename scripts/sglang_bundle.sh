#!/bin/bash
# SGLang on an air-gapped GPU machine, in one transfer.
#
#   scripts/sglang_bundle.sh build [OUT]   on a machine with network (needs a CPython 3.12 with pip;
#                                          set PY312 to choose one): downloads the wheels pinned in
#                                          scripts/sglang_wheels.txt (cp312 manylinux x86-64, no deps),
#                                          installs them into one site dir, prunes kernels the triton
#                                          attention path never loads and sources nothing reads (flashinfer's
#                                          JIT reads only its include dirs; tests, examples, C++ sources, the
#                                          cudnn frontend's headers; the diffusion runtime, which only
#                                          `sglang serve` reaches, not `python -m sglang.launch_server`),
#                                          strips debug info, and packs
#                                          OUT/parts/part_* (xz, <= 55 MiB each; ~45 MiB for 0.5.17).
#                                          Copy the parts into .bundle/ at the repository root.
#   scripts/sglang_bundle.sh stage          on the GPU machine: keeps the parts this call carried in
#                                          /tmp/sglang-parts, for a bundle sent over several calls
#                                          (parts of PART_MB=21 MiB, SHA256SUMS beside them); `run`
#                                          stages too and refuses an incomplete set, naming what is missing.
#   scripts/sglang_bundle.sh run CMD ...   on the GPU machine, from the repository root: unpacks
#                                          .bundle/part_* (or $BUNDLE_DIR) into /tmp/sglang-site once,
#                                          puts it and the repository first on PYTHONPATH and runs CMD,
#                                          e.g. `python3 -m refcheck diff --engine sglang ...`.
#   scripts/sglang_bundle.sh fits [LIMIT_KIB] whether the working tree (tracked and untracked-not-ignored files)
#                                          and .bundle/ fit one device call's transfer (default 65536 KiB,
#                                          counted in disk blocks as du counts them): prints both sizes
#                                          and the margin; exit 1 when they do not fit.
#   scripts/sglang_bundle.sh cpu [SITE] [VENV]
#                                          on a CPU machine (a CPython 3.12 with pip, the package index):
#                                          makes VENV (default /tmp/sglang-cpu) with CPU torch and the
#                                          packages SGLang's scheduler modules import that the GPU image
#                                          has and the bundle does not carry, and refcheck (--no-deps), so
#                                          the tests that build SGLang's own objects without a GPU run there:
#     PYTHONPATH=SITE:. VENV/bin/python -m pytest -o addopts= -m "sglang and not gpu" tests
#                                          (SITE: the build's OUT/site, default /tmp/sglang-bundle/site)
#
# The bundle targets Python 3.12 + torch 2.11 (SGLang 0.5.17 is the newest release pinned to it). Its
# transformers (5.12.1) shadows the machine's: refcheck's reference runs with it in-process.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
cmd=${1:-}; shift || true
case "$cmd" in
build)
  W=${1:-/tmp/sglang-bundle}
  if [ -z "${PY312:-}" ]; then
    for c in "$HOME"/.pyenv/versions/3.12*/bin/python python3.12; do
      "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { PY312=$c; break; }
    done
  fi
  [ -n "${PY312:-}" ] || { echo "sglang_bundle: need a CPython 3.12 with pip (set PY312)" >&2; exit 2; }
  mkdir -p "$W/whl" "$W/parts"
  grep -v '^\s*#' "$HERE/sglang_wheels.txt" | sed '/^\s*$/d' > "$W/reqs.txt"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$W/whl" -r "$W/reqs.txt"
  rm -rf "$W/site" && mkdir "$W/site"
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$W"/whl/*.whl
  (cd "$W/site"
   rm -rf bin sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100 sgl_kernel/infllm_ops*.so sgl_kernel/flashmla_ops.abi3.so \
          xgrammar/lib/libxgrammar.a tvm_ffi/src include sglang/multimodal_gen \
          flashinfer/data/cutlass/examples flashinfer/data/cutlass/test flashinfer/data/cutlass/python \
          flashinfer/data/cccl/python flashinfer/data/cccl/benchmarks flashinfer/data/cccl/ci flashinfer/data/cccl/docs \
          flashinfer/data/cccl/libcudacxx/test jsonschema/tests jsonschema/benchmarks dill/tests \
          sglang/srt/grpc/_core.*.so sglang/srt/server/_core.*.so sglang/srt/multimodal/_core.*.so  # gRPC / Rust server, image processing: never loaded offline
   find . -name __pycache__ -type d -prune -exec rm -rf {} +
   find . -name '*.so*' -type f | while read -r f; do file "$f" | grep -q 'with debug_info' && strip --strip-debug "$f" || true; done
   tar -cf - . | xz -T0 -9 > "$W/site.tar.xz")
  # parts of PART_MB (default 21) MiB: a device call sends at most 64 MiB with the working tree, so a bundle
  # that does not fit beside it goes over in several calls (`stage`), each carrying some of the parts
  (cd "$W" && rm -f parts/part_* parts/SHA256SUMS && split -b "${PART_MB:-21}m" -d site.tar.xz parts/part_ \
     && (cd parts && sha256sum part_* > SHA256SUMS))
  ls -la "$W"/parts/
  echo "next: mkdir -p .bundle && cp $W/parts/* .bundle/ && echo /.bundle/ >> .git/info/exclude"
  ;;
stage)
  # on the GPU machine: keep the parts this call carried (in .bundle/) under $SGLANG_PARTS (default
  # /tmp/sglang-parts), which outlives the call's working tree while the machine stays warm
  P=${SGLANG_PARTS:-/tmp/sglang-parts}
  mkdir -p "$P"
  for f in "$REPO"/.bundle/part_* "$REPO"/.bundle/SHA256SUMS; do [ -f "$f" ] && cp "$f" "$P/"; done
  ls "$P"
  ;;
fits)
  limit=${1:-65536}
  cd "$REPO"
  tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r du -c -- 2>/dev/null \
          | awk '$2 == "total" { t += $1 } END { print t + 0 }')
  bundle=$(du -s .bundle 2>/dev/null | cut -f1); bundle=${bundle:-0}
  margin=$(( limit - tree - bundle ))
  echo "tree ${tree} KiB + .bundle ${bundle} KiB = $(( tree + bundle )) KiB of ${limit} KiB: margin ${margin} KiB"
  [ "$margin" -ge 0 ]
  ;;
cpu)
  SITE=${1:-/tmp/sglang-bundle/site}; V=${2:-/tmp/sglang-cpu}
  [ -d "$SITE/sglang" ] || { echo "sglang_bundle: no SGLang in $SITE (run build first)" >&2; exit 2; }
  if [ -z "${PY312:-}" ]; then
    for c in "$HOME"/.pyenv/versions/3.12*/bin/python python3.12; do
      "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { PY312=$c; break; }
    done
  fi
  [ -n "${PY312:-}" ] || { echo "sglang_bundle: need a CPython 3.12 with pip (set PY312)" >&2; exit 2; }
  "$PY312" -m venv "$V"
  "$V/bin/python" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
  # what sglang.srt.managers.* imports beyond the bundle, at the versions the bundle's transformers (5.12.1) takes
  "$V/bin/python" -m pip install -q numpy psutil requests packaging pillow anyio torchvision tqdm pygments aiohttp \
    regex "huggingface_hub>=1.5,<2" safetensors "tokenizers>=0.22,<=0.23.0" sentencepiece einops \
    annotated-doc pyarrow click rich pytest pytest-xdist hypothesis
  "$V/bin/python" -m pip install -q --no-deps -e "$REPO"
  PYTHONPATH="$SITE:$REPO" "$V/bin/python" -c 'import sglang.srt.managers.schedule_batch, sglang; print("SGLang", sglang.__version__, "imports on the CPU")'
  ;;
run)
  [ $# -gt 0 ] || { echo "usage: sglang_bundle.sh run CMD ..." >&2; exit 2; }
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  B=${BUNDLE_DIR:-$REPO/.bundle}
  SITE=${SGLANG_SITE:-/tmp/sglang-site}
  if [ ! -f "$SITE/.ok" ] && [ -z "${BUNDLE_DIR:-}" ] && [ -f "${SGLANG_PARTS:-/tmp/sglang-parts}/SHA256SUMS" ]; then
    "$0" stage >/dev/null  # parts staged by earlier calls, plus this call's
    B=${SGLANG_PARTS:-/tmp/sglang-parts}
  fi
  if [ ! -f "$SITE/.ok" ]; then
    ls "$B"/part_* >/dev/null 2>&1 || { echo "sglang_bundle: no bundle parts in $B (build them first)" >&2; exit 2; }
    if [ -f "$B/SHA256SUMS" ]; then
      missing=$(cd "$B" && { sha256sum -c --quiet SHA256SUMS 2>/dev/null || true; } | sed 's/:.*//' | tr '\n' ' ')
      [ -z "$missing" ] || { echo "sglang_bundle: bundle parts missing or damaged in $B: $missing(send them, then stage)" >&2; exit 2; }
    fi
    mkdir -p "$SITE"
    cat "$B"/part_* | python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('$SITE')" \
      || { echo "sglang_bundle: extract failed" >&2; exit 3; }
    touch "$SITE/.ok"
  fi
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
  exec "$@"
  ;;
*)
  echo "usage: sglang_bundle.sh build [OUT] | stage | run CMD ... | fits [LIMIT_KIB] | cpu [SITE] [VENV]" >&2; exit 2 ;;
esac
