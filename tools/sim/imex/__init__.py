"""Simulated nvidia-imex daemon and its ctl tool.

Keep this package's __init__ empty: the daemon must start fast (no heavy imports).
"""
