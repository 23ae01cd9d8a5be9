# syntax=docker/dockerfile:1
# The node's image, built at the repository root: docker build -t aioparamsync:latest .
# Configured by environment: every flag of aioparamsync-node is also AIOPARAMSYNC_<FLAG>.

# The wheel, with the compiled fast path (a C compiler here only; the image has none).
# AIOPARAMSYNC_REQUIRE_EXT=1: a failed compile fails the build, rather than a slower image;
# -v: the build log shows the compile's progress, a line per module.
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,source=.,target=/src,rw \
    cd /src && AIOPARAMSYNC_REQUIRE_EXT=1 pip wheel -v --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim

# No bytecode to write (the root filesystem is read-only in the StatefulSet); logs unbuffered.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A numeric user, so that Kubernetes' runAsNonRoot can verify it; /data is its volume.
RUN groupadd --gid 10001 aioparamsync \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin aioparamsync \
 && mkdir /data \
 && chown 10001:10001 /data

# The wheel is mounted for the install only, so no copy of it stays in a layer; with /metrics
# and the etcd client (--coordinator).
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/aioparamsync-*.whl)[metrics,etcd]"

# Listen on every interface of the container; peers are told --advertise instead.
ENV AIOPARAMSYNC_HOST=0.0.0.0 \
    AIOPARAMSYNC_PORT=9090 \
    AIOPARAMSYNC_METRICS_PORT=9100 \
    AIOPARAMSYNC_DATA_DIR=/data

USER 10001:10001
EXPOSE 9090 9100
ENTRYPOINT ["aioparamsync-node"]
