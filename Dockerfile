# reputd container images.
#
#   docker build -t reputd .                           # the daemon (`reputd run`): the last stage, "runtime"
#   docker build -t reputd-backfill --target backfill . # adds a Java 17 runtime for `reputd backfill` (PySpark)
#
# With podman or buildah add --format docker: their default OCI image format has no HEALTHCHECK, so the
# check below would be dropped (with only a warning).
#
#   docker run -d --name reputd -p 127.0.0.1:9108:9108 \
#       -e REPUTD_STORE_MAPPED_FILE_SIZE_COMMIT_LOG=1073741824 \
#       -e REPUTD_STORE_MAPPED_FILE_SIZE_CONSUME_QUEUE=6000000 \
#       -e REPUTD_STORE_MAX_HASH_SLOT_NUM=5000000 -e REPUTD_STORE_MAX_INDEX_NUM=20000000 \
#       -v /data/rocketmq/store:/store:ro -v reputd-out:/out reputd
#
# The store is mounted read-only at /store (reputd only reads the CommitLog under it) and the output
# (consumequeue/, index/, checkpoint) goes to /out. The four sizes are required: the config in the image has
# demo sizes, so give the broker's broker.conf values (the numbers above are RocketMQ's defaults). They must
# match the broker's, or segments are refused as the wrong size (the daemon stays "down") and the files are
# not the broker's. Any config key can be overridden with -e REPUTD_<SECTION>_<KEY>=...; for a whole config,
# mount it over /etc/reputd/reputd.yaml.
#
#   docker run --rm -v /data/rocketmq/store:/store:ro -v reputd-out:/out -v reputd-cache:/cache \
#       reputd-backfill backfill --config /etc/reputd/reputd.yaml --master 'local[*]'
#
# The backfill's driver JVM starts from the class archive the image holds under /cache (XDG_CACHE_HOME); a
# named volume there (optional) also keeps the ones later backfills record, such as a cluster driver's.

# Pinned to bookworm, not the floating python:3.11-slim: the Debian release under that tag moves, and
# openjdk-17-jre-headless, which the backfill stage needs, is a bookworm package. All stages share this base so
# the virtualenv built in "build" (whose python is a symlink to /usr/local/bin/python3.11) runs in the others.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: install the project and its dependencies into /opt/reputd ---------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# A C compiler and zlib's header for indexcore/_kernels.c; only this stage has them (the others need
# libz.so.1, which the base image already has). Debian's versions are left unpinned: the stable release
# only takes security fixes, and a pinned version disappears from its mirrors when the next one lands.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev zlib1g-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/reputd
WORKDIR /src
# Only what the package build reads: pyproject.toml (metadata, dependencies), README.md (its `readme`) and
# the two packages. Tests, benchmarks and stores stay out of the image.
COPY pyproject.toml setup.py README.md ./
COPY daemon/ daemon/
COPY indexcore/ indexcore/
# A regular (not editable) install of the runtime dependencies only: no [test] extras.
RUN /opt/reputd/bin/pip install --no-cache-dir . \
    && /opt/reputd/bin/reputd --help > /dev/null

# --- build-backfill: the same virtualenv with the [backfill] extra -------------------------------------
FROM build AS build-backfill
# PySpark (with pandas and pyarrow, its Arrow exchange) is the project's [backfill] extra (same specs as in
# pyproject.toml), kept out of the daemon image. Then pip and setuptools leave the virtualenv: nothing in the
# image installs anything, and they are about 20 MB.
RUN /opt/reputd/bin/pip install --no-cache-dir "pyspark[sql]>=3.5,<5" "pyarrow>=15" "pandas>=2.2,<3" \
    && /opt/reputd/bin/python -m pip uninstall --yes --quiet pip setuptools

# --- build-runtime: the daemon's virtualenv without pip and setuptools ----------------------------------
FROM build AS build-runtime
RUN /opt/reputd/bin/python -m pip uninstall --yes --quiet pip setuptools \
    && /opt/reputd/bin/reputd --help > /dev/null

# --- base: what the daemon and the backfill images share -----------------------------------------------
FROM ${PYTHON_IMAGE} AS base
# A fixed, non-root uid/gid, so the owner of files on mounted volumes is predictable on the host
# (chown 10001 the output directory when it is a bind mount). /cache is its XDG_CACHE_HOME: the user has
# no home, and without a cache directory the backfill's class archive (and the queries' parsed-config memo)
# had nowhere to go.
RUN groupadd --system --gid 10001 reputd \
    && useradd --system --uid 10001 --gid reputd --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin reputd \
    && mkdir -p /store /out /cache \
    && chown reputd:reputd /store /out /cache
COPY config/reputd.yaml /etc/reputd/reputd.yaml
ENV PATH=/opt/reputd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_CACHE_HOME=/cache \
    REPUTD_STORE_STORE_PATH_ROOT_DIR=/store \
    REPUTD_OUTPUT_DIR=/out \
    REPUTD_METRICS_HOST=0.0.0.0
# REPUTD_METRICS_HOST: the config's default, 127.0.0.1, is the container's own loopback, which a published
# port (-p) cannot reach; 0.0.0.0 makes the endpoint reachable, and `-p 127.0.0.1:9108:9108` keeps it off
# the host's network. The endpoint has no authentication.
# Logs are JSON lines on stdout (`docker logs`). IndexFile names use local time, as the broker's do: set
# TZ to the broker's zone (e.g. -e TZ=Asia/Shanghai) if names should line up with the broker's.
WORKDIR /out
VOLUME ["/store", "/out"]

# --- backfill: `reputd backfill` runs PySpark, which needs a Java 17 runtime -------------------------
FROM base AS backfill
COPY --from=build-backfill /opt/reputd /opt/reputd
ENV REPUTD_IMAGE=backfill
# The man1 directory: some openjdk packages' postinst fails on slim images without it (harmless otherwise).
# hadolint ignore=DL3008
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* \
    && java -version
USER 10001:10001
# The driver JVM's class archive (backfill.jvmClassArchive: auto), recorded here once by a small local backfill as
# the image's user: every container maps it from its first backfill. Without it each new container would record
# its own as it ends (about 4 s more, and 2 s more of start), unless a volume on /cache kept it; a new named
# volume there starts with this one.
RUN work=$(mktemp -d) \
    && export REPUTD_STORE_STORE_PATH_ROOT_DIR="$work/store" REPUTD_OUTPUT_DIR="$work/out" \
    && reputd produce --config /etc/reputd/reputd.yaml --messages 2000 > /dev/null \
    && reputd backfill --config /etc/reputd/reputd.yaml --master 'local[1]' --conf spark.ui.enabled=false > /dev/null \
    && rm -rf "$work" \
    && ls /cache/reputd/spark-driver-*.jsa
ENTRYPOINT ["reputd"]
CMD ["backfill", "--config", "/etc/reputd/reputd.yaml"]

# --- runtime: the daemon, `reputd run` (last stage, so a plain `docker build .` produces it) -----------
FROM base AS runtime
COPY --from=build-runtime /opt/reputd /opt/reputd
# REPUTD_IMAGE: `reputd backfill` here says to use the backfill image (this one has no PySpark, Java or pip).
ENV REPUTD_IMAGE=runtime
USER 10001:10001
EXPOSE 9108
# daemon/ops/healthcheck.py asks /healthz (slim images have no curl) and prints one line, e.g.
# "down: CommitLog directory missing ... (HTTP 503)", which `docker inspect` shows in State.Health.Log:
# "down" or no answer exits 1, "healthy" or "degraded" exits 0. The port follows REPUTD_METRICS_PORT when it
# is set with -e (a port changed only in a mounted config file also needs -e REPUTD_METRICS_PORT). Start
# period: crash recovery runs before the endpoint reports healthy. With metrics.enabled=false there is no
# endpoint: run with --no-healthcheck then.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "daemon.healthcheck"]
# SIGTERM (docker stop) makes reputd finish its batch, flush and checkpoint within reput.shutdownTimeoutMs
# (10 s); docker stop's default grace period is also 10 s, so use `docker stop -t 30` (or stop_grace_period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["reputd"]
CMD ["run", "--config", "/etc/reputd/reputd.yaml"]
