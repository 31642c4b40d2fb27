"""Chaos soak: random jobs and real faults on a cdsim cluster, with the invariants of docs/state-model.md checked
all along (`python -m tools.chaos --duration S --seed N`)."""
