#!/bin/sh
# Run inference-perf 0.7.0 (shared-prefix workload, closed loop) against an OpenAI-compatible base
# URL on this machine, in a container (inference-perf needs Python >= 3.12; the host has 3.11).
#
#   lab/tools/inference_perf/run.sh BASE_URL OUTDIR [key=value ...]   build if missing, then run
#   lab/tools/inference_perf/run.sh --build [--rebuild]               only build the image
#
# BASE_URL: the server's base URL without /v1 (e.g. http://127.0.0.1:10000, Envoy's listener or a
# replica). Loopback only (127.0.0.1, localhost, [::1]) unless IP_ALLOW_REMOTE=1.
# OUTDIR gets config.yaml (what ran), inference-perf.log, reports/ (inference-perf's JSON) and
# summary.txt; the last line printed is the summary: TTFT p50/p90 (ms), requests/s, the report.
# Overrides: see driver.py (num_groups=8 num_prompts_per_group=4 output_len=32 concurrency=4
# wire=chat|completions max_seconds=120 model=NAME, or any dotted path of inference-perf's config).
#
# The image is built from local parts only (each step skipped while its result exists):
#   base    $IP_BASE_IMAGE: compose/build-local-images.sh's base step on Debian trixie (Python
#           3.13): debootstrap --variant=minbase with python3, python3-venv and ca-certificates
#           from the mirror apt uses, docker import.
#   wheels  $IP_CACHE_DIR/wheelhouse: `pip download inference-perf==0.7.0` for CPython 3.13 on
#           manylinux (this machine's arch), binary wheels only, through the host's pip index.
#   image   $IP_IMAGE: `docker build --network none` of the Dockerfile beside this script.
# --rebuild makes the wheelhouse and the image again (not the base: remove it by hand).
#
# Env: IP_IMAGE (local/inference-perf:0.7.0), IP_BASE_IMAGE (local/python:3.13-trixie),
#      IP_CACHE_DIR (/var/tmp/routerlab-inference-perf), IP_TOKENIZER (the lab's tiny-bytelevel),
#      IP_CPUS (docker run --cpus, default unlimited), DEBIAN_MIRROR (read from /etc/apt),
#      PYTHON (the repo's .venv/bin/python, else python3; used for pip download).
# Needs: a Docker engine (sh .ci/machine, as root), debootstrap and root for the base image.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
VERSION=0.7.0
PY_VERSION=3.13
SUITE=trixie
IMAGE=${IP_IMAGE:-local/inference-perf:$VERSION}
BASE_IMAGE=${IP_BASE_IMAGE:-local/python:$PY_VERSION-$SUITE}
CACHE=${IP_CACHE_DIR:-/var/tmp/routerlab-inference-perf}
TOKENIZER=${IP_TOKENIZER:-$REPO/lab/routerlab/assets/tiny-bytelevel}
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi

say() { echo "inference-perf: $*" >&2; }
die() { say "$*"; exit 1; }
now() { date +%s; }

usage() { sed -n '2,27p' "$0"; }

# The base is the compose images' step, on Debian $SUITE (compose/build-local-images.sh base).
build_base() {
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        say "base: $BASE_IMAGE exists"
        return 0
    fi
    t0=$(now)
    DEBIAN_SUITE=$SUITE BASE_IMAGE=$BASE_IMAGE nice -n 10 sh "$REPO/compose/build-local-images.sh" base \
        || die "base: compose/build-local-images.sh base failed"
    say "base: $BASE_IMAGE in $(($(now) - t0)) s"
}

build_wheels() {  # [--rebuild]
    wh=$CACHE/wheelhouse
    if [ "${1:-}" != --rebuild ] && [ -f "$wh/inference_perf-$VERSION-py3-none-any.whl" ]; then
        say "wheels: $wh has inference-perf $VERSION ($(ls "$wh" | wc -l) wheels)"
        return 0
    fi
    arch=$(uname -m)
    platforms="--platform manylinux2014_$arch"
    for minor in 17 24 26 27 28 31 34 35 36 38 39 40 41; do
        platforms="$platforms --platform manylinux_2_${minor}_$arch"
    done
    t0=$(now)
    rm -rf "$wh"
    mkdir -p "$wh"
    say "wheels: pip download inference-perf==$VERSION for CPython $PY_VERSION on manylinux $arch into $wh"
    log=$(mktemp /tmp/routerlab-ip-wheels.XXXXXX)
    # shellcheck disable=SC2086  # $platforms is a list of flags
    nice -n 10 "$PYTHON" -m pip download --disable-pip-version-check --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp $platforms \
        -d "$wh" "inference-perf==$VERSION" >"$log" 2>&1 \
        || { tail -n 30 "$log" >&2; rm -f "$log"; die "wheels: pip download failed"; }
    rm -f "$log"
    say "wheels: $(ls "$wh" | wc -l) wheels, $(du -sh "$wh" | cut -f1), in $(($(now) - t0)) s"
}

build_image() {  # [--rebuild]
    if [ "${1:-}" != --rebuild ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
        say "image: $IMAGE exists"
        return 0
    fi
    t0=$(now)
    say "image: docker build --network none -t $IMAGE (pip install from the wheelhouse)"
    log=$(mktemp /tmp/routerlab-ip-build.XXXXXX)
    nice -n 10 docker build --force-rm --network none --build-arg "BASE=$BASE_IMAGE" \
        --build-arg "VERSION=$VERSION" -f "$HERE/Dockerfile" -t "$IMAGE" "$CACHE" >"$log" 2>&1 \
        || { tail -n 40 "$log" >&2; rm -f "$log"; die "image: docker build failed"; }
    rm -f "$log"
    docker image prune -f --filter "label=routerlab.tool=inference-perf" --filter dangling=true >/dev/null 2>&1 || true
    say "image: $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')) in $(($(now) - t0)) s"
}

ensure_image() {  # [--rebuild]
    docker info >/dev/null 2>&1 || die "no Docker engine answers: run 'sh .ci/machine' (as root) first"
    if [ "${1:-}" != --rebuild ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
        say "image: $IMAGE exists"
        return 0
    fi
    started=$(now)
    build_base
    build_wheels "${1:-}"
    build_image "${1:-}"
    say "build: done in $(($(now) - started)) s"
}

case "${1:-}" in
    -h|--help|'') usage; [ -n "${1:-}" ] && exit 0; exit 2 ;;
    --build) ensure_image "${2:-}"; exit 0 ;;
esac

[ $# -ge 2 ] || { usage; exit 2; }
BASE_URL=${1%/}
OUTDIR=$2
shift 2

case "$BASE_URL" in
    http://127.0.0.1:*|http://127.0.0.1|http://localhost:*|http://localhost|http://\[::1\]:*) ;;
    *) [ "${IP_ALLOW_REMOTE:-0}" = 1 ] || die "BASE_URL $BASE_URL is not on loopback (IP_ALLOW_REMOTE=1 to allow)" ;;
esac
case "$BASE_URL" in */v1) die "BASE_URL is the base without /v1 (inference-perf adds /v1/...)" ;; esac
[ -f "$TOKENIZER/tokenizer.json" ] || die "no tokenizer.json in $TOKENIZER (IP_TOKENIZER)"

ensure_image

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
TOKENIZER=$(cd "$TOKENIZER" && pwd)
NAME=routerlab-inference-perf-$$
cpus=""
[ -z "${IP_CPUS:-}" ] || cpus="--cpus=$IP_CPUS"
# The container is removed however this script ends (docker run --rm covers a normal exit).
trap 'docker rm -f "$NAME" >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT TERM
say "run: $NAME against $BASE_URL, out $OUTDIR"
rc=0
# shellcheck disable=SC2086  # $cpus is empty or one flag
docker run --rm --name "$NAME" --network host --user "$(id -u):$(id -g)" $cpus \
    -v "$TOKENIZER:/tokenizer:ro" -v "$HERE:/opt/routerlab-ip:ro" -v "$OUTDIR:/out" \
    "$IMAGE" python3 /opt/routerlab-ip/driver.py --base-url "$BASE_URL" --out /out --shown-out "$OUTDIR" "$@" \
    || rc=$?
exit "$rc"
