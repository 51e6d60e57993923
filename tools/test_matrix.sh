#!/usr/bin/env bash
# The test suite on several torch releases, one virtual environment per release.
#
#   tools/test_matrix.sh                  # 2.6.0 (oldest supported), 2.9.1, 2.13.0 (pinned), 2.14.1
#   tools/test_matrix.sh 2.6.0 2.14.1     # only these
#   MATRIX_SETUP_ONLY=1 tools/test_matrix.sh 2.6.0   # make the environment, run nothing
#   PYTEST_ARGS='-m "not slow"' tools/test_matrix.sh 2.6.0
#
# The environments live outside the checkout, in $MATRIX_DIR (default
# ~/.cache/amp_patch/venvs/torch-X): all but 2.13.0 are CUDA builds of torch with
# their nvidia-* wheels, several GB each, which import and run on the CPU. Each is
# made once and reused. The checkout (tracked and untracked, not ignored, files) is
# copied into the environment's src/ and installed there as `make install` does
# (AMP_PATCH_BUILD_EXT=1, CPU kernels only: AMP_PATCH_NO_CUDA=1), then the suite
# runs there with AMP_PATCH_REQUIRE_EXT=1, like `make test`. The versions run one
# after the other. A summary line per version goes to stdout and to
# $MATRIX_DIR/results.txt. The exit status is 1 when any version failed.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
CACHE=${AMP_PATCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/amp_patch}
MATRIX_DIR=${MATRIX_DIR:-$CACHE/venvs}
PYTHON=${PYTHON:-python3}
PYTEST_ARGS=${PYTEST_ARGS:-}
export MAX_JOBS=${MAX_JOBS:-2}
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(2.6.0 2.9.1 2.13.0 2.14.1)
mkdir -p "$MATRIX_DIR"

setup_env() {  # $1: torch version, $2: venv directory
    local v=$1 venv=$2
    [ -f "$venv/.deps-stamp" ] && return 0
    echo "== torch $v: making $venv (downloads torch and its dependencies once)"
    "$PYTHON" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install -q --upgrade pip || return 1
    # requirements-dev.txt without its torch pin, then this torch.
    grep -v '^torch==' requirements-dev.txt > "$venv/requirements.txt"
    "$venv/bin/python" -m pip install -q "torch==$v" -r "$venv/requirements.txt" || return 1
    "$venv/bin/python" -m pip install -q --no-deps -r requirements-nodeps.txt || return 1
    touch "$venv/.deps-stamp"
}

install_project() {  # $1: venv directory
    local venv=$1 src=$1/src
    mkdir -p "$src"
    # This checkout's files (committed or not, never ignored ones) in place of the previous
    # copy; the copy's build/ is kept, so a rerun compiles only what changed.
    find "$src" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
    git ls-files -co --exclude-standard -z \
        | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$src" || return 1
    (cd "$src" && AMP_PATCH_BUILD_EXT=1 AMP_PATCH_NO_CUDA=1 \
        "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .) || return 1
}

status=0
for v in "${versions[@]}"; do
    venv="$MATRIX_DIR/torch-$v"
    start=$(date +%s)
    if ! setup_env "$v" "$venv"; then
        echo "torch $v: could not make the environment" | tee -a "$MATRIX_DIR/results.txt"
        status=1; continue
    fi
    [ "${MATRIX_SETUP_ONLY:-0}" = 1 ] && continue
    if ! install_project "$venv"; then
        echo "torch $v: could not install amp_patch" | tee -a "$MATRIX_DIR/results.txt"
        status=1; continue
    fi
    built=$(date +%s)
    log="$MATRIX_DIR/torch-$v.log"
    echo "== torch $v: running the suite (log: $log)"
    (cd "$venv/src" && eval AMP_PATCH_REQUIRE_EXT=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider $PYTEST_ARGS) > "$log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -1 \
        | sed 's/=//g; s/^ *//; s/ *$//')
    line="$(date -u +%Y-%m-%dT%H:%MZ) $(hostname) torch $v ($("$venv/bin/python" -c 'import torch; print(torch.version.cuda and "CUDA " + torch.version.cuda + " build" or "CPU build")')): ${summary:-no summary, exit $rc}; install $((built - start)) s, suite $(( $(date +%s) - built )) s"
    echo "$line" | tee -a "$MATRIX_DIR/results.txt"
done
exit $status
