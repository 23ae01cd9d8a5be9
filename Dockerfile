# syntax=docker/dockerfile:1
# The node's image, built at the repository root: docker build -t aioparamsync:latest .
# Configured by environment: every flag of aioparamsync-node is also AIOPARAMSYNC_<FLAG>.
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

# The checkout is mounted for the install only, so no copy of the source stays in a layer.
RUN --mount=type=bind,source=.,target=/src,rw \
    cd /src && pip install --no-cache-dir '.[metrics]'

# Listen on every interface of the container; peers are told --advertise instead.
ENV AIOPARAMSYNC_HOST=0.0.0.0 \
    AIOPARAMSYNC_PORT=9090 \
    AIOPARAMSYNC_METRICS_PORT=9100 \
    AIOPARAMSYNC_DATA_DIR=/data

USER 10001:10001
EXPOSE 9090 9100
ENTRYPOINT ["aioparamsync-node"]
