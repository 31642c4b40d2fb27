"""The driver's contract with its users and with kubelet, in one place.

Names users of NVIDIA's ComputeDomain driver already write into their manifests (the DRA driver
name, the channel device and its class, the opaque ComputeDomainChannelConfig), and the records
the simulation's claim source reads. Services, cdsim, the chaos soak and the benchmarks import
them from here.
"""
