"""IMEX daemon configuration and the simulated IMEX daemon."""
