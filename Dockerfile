# syntax=docker/dockerfile:1
# One image for every container of docker-compose.yml: the Python package (cd-controller,
# cd-node-agent, cd-imex-agent, cd-placement-advisor, cdctl, cdsim, imex-sim, the dashboard) and
# etcd. `make image` builds it with buildah (tools/image/build.sh); docker and podman build it too.
#
# BASE_IMAGE: any Debian bookworm image with python3.11 and its venv module. Elsewhere the stock
# Python image; where no registry is reachable, `make image` passes a base made from Debian's
# packages with mmdebstrap (tools/image/base.sh).
# etcd is not compiled here (no Go toolchain in any stage): build/image/etcd is the static binary
# that tools/image/build.sh builds from the pinned Go module in tools/etcd and puts in the context.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A virtual environment at the path it keeps in the final stage: the same on either base (the stock
# image's python and Debian's), and Debian's python refuses a system-wide pip install (PEP 668).
RUN python3 -m venv /opt/computedomains
# The dependencies first, from pyproject.toml's list pinned by constraints.txt: a change of the
# project's code then reuses this layer. The build machine's CA bundle, when given as the secret
# `pip-ca` (tools/image/build.sh does), is what pip trusts: egress through a TLS-inspecting proxy.
# It is mounted for the step only, never stored in the image.
COPY pyproject.toml constraints.txt ./
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/computedomains/bin/pip install -c constraints.txt \
      $(python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"])')
COPY libs ./libs
COPY services ./services
COPY tools ./tools
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/computedomains/bin/pip install --no-deps -c constraints.txt . \
 && /opt/computedomains/bin/pip uninstall --yes pip setuptools

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/computedomains/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY --from=build /opt/computedomains /opt/computedomains
COPY build/image/etcd /usr/local/bin/etcd

# The simulated NVL72 hardware the node agents run on (--hardware simulated): the cluster
# description and each node's simulated /proc/devices and /dev, baked in so every agent container
# starts with its own copy. Keep SIM_RACKS x SIM_TRAYS in step with the agents of
# docker-compose.yml (tests/compose checks it).
ARG SIM_RACKS=1
ARG SIM_TRAYS=4
ENV CD_SIM_DIR=/var/lib/cdsim
RUN python -c 'import os, pathlib; from tools.sim.hardware.cluster import ClusterDescription; from tools.sim.hardware.simulated import prepare_node_dirs; base = pathlib.Path(os.environ["CD_SIM_DIR"]); cluster = ClusterDescription(racks=int(os.environ["SIM_RACKS"]), trays_per_rack=int(os.environ["SIM_TRAYS"])); base.mkdir(parents=True, exist_ok=True); cluster.save(base / "cluster.json"); [prepare_node_dirs(cluster, name, base / "nodes") for name in cluster.node_names()]'

# No entry point: each compose service names its program (see docker-compose.yml).
CMD ["cdctl", "--help"]
