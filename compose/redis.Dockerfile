# A local stand-in for redis:7.4-alpine where no registry is reachable: Debian bookworm's
# redis-server (7.0) unpacked onto the local Debian base. compose/build-local-images.sh builds it
# from a context holding the .deb files (downloaded on the host by apt-get download).
# The routers use it for pub/sub only (--share-in-flight): it stores nothing.
ARG BASE=local/python:3.11-bookworm
FROM ${BASE}
COPY *.deb /tmp/debs/
# dpkg-deb -x, not dpkg -i: the packages' maintainer scripts want systemd and adduser, and
# an image needs only the files. uid 999 is the redis user of the official image too.
RUN for deb in /tmp/debs/*.deb; do dpkg-deb -x "$deb" /; done \
 && rm -rf /tmp/debs \
 && ln -sf redis-check-rdb /usr/bin/redis-server \
 && echo 'redis:x:999:999:redis:/data:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'redis:x:999:' >>/etc/group \
 && mkdir -p /data && chown 999:999 /data \
 && redis-server --version
USER 999:999
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--save", "", "--appendonly", "no"]
