"""`python -m tools.dashboard`: the live dashboard (see tools.dashboard.main)."""

from tools.dashboard.main import main

main()
