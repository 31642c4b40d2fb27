"""The loopback blocks (127.<block>.x.y) that tests run simulated nodes on at fixed numbers.

A node's programs bind fixed ports on its address (the IMEX daemon's, the agents' health port),
so two clusters up at once on one block collide. Tests that pick a block at run time take none
of these: tests/e2e's Kubernetes environment lasts the whole session, while later modules start
their own clusters. Modules that share a block run one after the other and stop their cluster.
"""

from __future__ import annotations

CHAOS_SOAK = 62
SECURED_RUN = 64
ETCD_AUTH_RECOVERY = 65
CDSIM_SECURE = 66  # the default (secured) cdsim run
CDSIM_PLAINTEXT = 67  # cdsim up --plaintext
CDSIM_CLUSTER = 77
CDSIM = 79  # test_continuity and test_kubernetes_mode
CDSIM_DOWN_DURING_START = 80
CDSIM_MESH_TLS = 83
CDSIM_FAULTS = 86
CDSIM_RECOVERY = 88
DASHBOARD = 91
HOSTILE_CDSIM = 93
CHART_SERVICES = 110  # tests/k8s/test_helm_services.py: the chart's node programs

FIXED = frozenset(
    {
        CHAOS_SOAK,
        SECURED_RUN,
        ETCD_AUTH_RECOVERY,
        CDSIM_SECURE,
        CDSIM_PLAINTEXT,
        CDSIM_CLUSTER,
        CDSIM,
        CDSIM_DOWN_DURING_START,
        CDSIM_MESH_TLS,
        CDSIM_FAULTS,
        CDSIM_RECOVERY,
        DASHBOARD,
        HOSTILE_CDSIM,
        CHART_SERVICES,
    }
)
