"""The invariants of the state model, checked against the real store, node-local files and processes.

One strict checker, used by the tests, `cdsim check`, the demo and the chaos soak
(docs/state-model.md lists the invariants).
"""
