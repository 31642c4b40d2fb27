"""Load a stand-in of tools/sim (simulated hardware, the IMEX simulator) by its dotted name.

The product never imports the rig (tests/architecture/test_rig_imports.py): where a program can
run on a stand-in, the port that chooses the backend names it as ``"module:attribute"`` and
imports it here at run time, so no module of libs/ or services/ depends on tools/ and a program
told to use real hardware never loads the simulation.
"""

from __future__ import annotations

import importlib


def load_standin(dotted: str) -> object:
    """The object ``"package.module:Name.attribute"`` names (ImportError, AttributeError if absent)."""
    module_name, sep, path = dotted.partition(":")
    if not sep or not module_name or not path:
        raise ValueError(f"not a stand-in name (want 'package.module:attribute'): {dotted!r}")
    found: object = importlib.import_module(module_name)
    for attribute in path.split("."):
        found = getattr(found, attribute)
    return found
