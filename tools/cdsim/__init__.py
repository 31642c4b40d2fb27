"""`cdsim`: run a simulated NVL72 cluster (etcd, controller, advisor, node agents) and jobs on it."""
