"""``python -m tools.kubeletshim``."""

import sys

from tools.kubeletshim.main import main

sys.exit(main())
