"""Fast entry point of the simulated IMEX daemon, run as a script (never imported).

``python -I -S <repo>/tools/sim/imex/run_daemon.py -c <config.cfg>`` starts the same daemon
as ``python -m tools.sim.imex.daemon -c <config.cfg>``, skipping ``site`` and ``runpy``
(about a third of the start-up cost on a small machine). A main script is compiled on every run,
so this one stays tiny and the daemon module comes from its bytecode cache.
"""

import sys

if __name__ == "__main__":
    # This file is <root>/tools/sim/imex/run_daemon.py; put <root> on the path (-I omits it).
    sys.path.insert(0, __file__[: -len("tools/sim/imex/run_daemon.py")] or ".")
    from tools.sim.imex.daemon import main

    sys.exit(main(sys.argv[1:]))
