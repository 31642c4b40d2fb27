# syntax=docker/dockerfile:1
# One image for every container of docker-compose.yml: the Python package (cd-controller,
# cd-node-agent, cd-placement-advisor, cdctl, cdsim, imex-sim, the dashboard) and etcd, built
# from the same pinned Go module as `make setup` (tools/etcd).

FROM golang:1.26-bookworm AS etcd
WORKDIR /src
COPY tools/etcd/go.mod tools/etcd/go.sum tools/etcd/main.go ./
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/etcd .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/computedomains
COPY pyproject.toml constraints.txt ./
COPY libs ./libs
COPY services ./services
COPY tools ./tools
RUN pip install -c constraints.txt .
COPY --from=etcd /out/etcd /usr/local/bin/etcd

# The simulated NVL72 hardware the node agents run on (--hardware simulated): the cluster
# description and each node's simulated /proc/devices and /dev, baked in so every agent container
# starts with its own copy. Keep SIM_RACKS x SIM_TRAYS in step with the agents of
# docker-compose.yml (tests/compose checks it).
ARG SIM_RACKS=1
ARG SIM_TRAYS=4
ENV CD_SIM_DIR=/var/lib/cdsim
RUN python -c 'import os, pathlib; from libs.hardware.cluster import ClusterDescription; from libs.hardware.simulated import prepare_node_dirs; base = pathlib.Path(os.environ["CD_SIM_DIR"]); cluster = ClusterDescription(racks=int(os.environ["SIM_RACKS"]), trays_per_rack=int(os.environ["SIM_TRAYS"])); base.mkdir(parents=True, exist_ok=True); cluster.save(base / "cluster.json"); [prepare_node_dirs(cluster, name, base / "nodes") for name in cluster.node_names()]'

# No entry point: each compose service names its program (see docker-compose.yml).
CMD ["cdctl", "--help"]
