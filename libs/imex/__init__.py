"""IMEX daemon configuration, driver support and the IMEX daemon port (libs/imex/daemon_port.py).

The simulated daemon that implements the port lives with the rest of the rig in tools/sim/imex.
"""
