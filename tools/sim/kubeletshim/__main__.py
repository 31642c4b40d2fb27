"""``python -m tools.sim.kubeletshim``."""

import sys

from tools.sim.kubeletshim.main import main

sys.exit(main())
