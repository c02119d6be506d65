# Container images of the prefix router (the default target) and of the vLLM simulator
# (--target sim), from one Dockerfile.
#
#   docker build -t envoy-prefix-router:0.1.0 .                    # wheels from the index (PyPI)
#   docker build --target sim -t envoy-prefix-router-sim:0.1.0 .   # + the lab (lab/), for `sim`
#   compose/build-local-images.sh                                  # offline: local base + wheelhouse
#
# Build args:
#   BASE        a Python 3.11 image with python3 and its venv module (default: the official
#               python:3.11-slim; compose/build-local-images.sh uses local/python:3.11-bookworm,
#               made from Debian packages, where python3 is /usr/bin/python3).
#   WHEELHOUSE  a folder of the build context holding every wheel to install, this project's
#               and its lab included (`pip wheel --wheel-dir compose/wheelhouse . ./lab` on the host): pip
#               then installs from it alone (--no-index), so the build needs no network.
#               Empty (the default): the package is built from this source tree and its
#               dependencies come from the index.
#
# The runtime stages copy only /opt/venv onto BASE: no compilers, no pip, no source tree.
# They run as uid 10001 (non-root, numeric so Kubernetes' runAsNonRoot can check it).

ARG BASE=python:3.11-slim

# ---- builders ------------------------------------------------------------------------------
FROM ${BASE} AS build
LABEL envoy-prefix-router.stage=build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
ARG WHEELHOUSE=
# With WHEELHOUSE: just the wheels (so an edit elsewhere in the tree keeps this build cached);
# without: the build context, which .dockerignore narrows to pyproject.toml, README.md, extproc/, lab/.
COPY ${WHEELHOUSE:-.} /src/
RUN if [ -n "$WHEELHOUSE" ]; then \
        /opt/venv/bin/pip install --no-index --find-links /src envoy-prefix-router; \
    else \
        /opt/venv/bin/pip install /src; \
    fi

FROM build AS build-router
RUN /opt/venv/bin/pip uninstall -y -q pip setuptools

FROM build AS build-sim
ARG WHEELHOUSE=
RUN if [ -n "$WHEELHOUSE" ]; then \
        /opt/venv/bin/pip install --no-index --find-links /src envoy-prefix-router-lab; \
    else \
        /opt/venv/bin/pip install /src/lab; \
    fi \
 && /opt/venv/bin/pip uninstall -y -q pip setuptools

# ---- runtime -------------------------------------------------------------------------------
FROM ${BASE} AS runtime
# No useradd on a minbase Debian: write the account directly (works on both bases).
RUN echo 'prefix-router:x:10001:10001:prefix router:/home/prefix-router:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'prefix-router:x:10001:' >>/etc/group \
 && mkdir -p /home/prefix-router && chown 10001:10001 /home/prefix-router
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/prefix-router
USER 10001:10001
ENTRYPOINT ["prefix-router"]
LABEL org.opencontainers.image.version="0.1.0" envoy-prefix-router.stage=runtime

# Simulated vLLM replicas for the cpu profile: `sim --replicas N --base-port P`.
FROM runtime AS sim
COPY --from=build-sim /opt/venv /opt/venv
LABEL org.opencontainers.image.title="prefix-router-sim" \
      org.opencontainers.image.description="simulated vLLM replicas (prefix-router sim)"
EXPOSE 8100
CMD ["sim", "--host", "0.0.0.0", "--base-port", "8100"]

# The ext_proc server (the default target: keep it last).
FROM runtime AS router
COPY --from=build-router /opt/venv /opt/venv
LABEL org.opencontainers.image.title="prefix-router" \
      org.opencontainers.image.description="Envoy ext_proc server keying LLM requests by prompt prefix"
# Bind address and ports as env vars (`serve` reads PREFIX_ROUTER_*; a flag would win over
# them): one `-e PREFIX_ROUTER_PORT=...` moves both the server and the health check below.
ENV PREFIX_ROUTER_HOST=0.0.0.0 PREFIX_ROUTER_PORT=50051 PREFIX_ROUTER_METRICS_PORT=9464
# 50051: ext_proc + grpc.health.v1 (Kubernetes: `grpc: {port: 50051}` probes); 9464: /metrics.
EXPOSE 50051 9464
# grpc.health.v1 Check of the ext_proc service, as Envoy's health check asks for it; it reads
# PREFIX_ROUTER_HOST/PORT like `serve`, and turns NOT_SERVING as soon as a SIGTERM starts the drain.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["prefix-router", "health"]
CMD ["serve"]
