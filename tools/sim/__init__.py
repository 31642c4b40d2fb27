"""Stand-ins for what cannot run here: simulated hardware, the IMEX simulator, the kubelet shim and the scale hosts."""
