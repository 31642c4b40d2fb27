"""Moved to ``services.imexagent`` (the IMEX side is its own program, ``cd-imex-agent``).

A re-export for modules that still import the supervisor from here.
"""

from services.imexagent.settings import ImexSettings
from services.imexagent.supervisor import ImexSupervisor, PrefixWatcher

__all__ = ["ImexSettings", "ImexSupervisor", "PrefixWatcher"]
