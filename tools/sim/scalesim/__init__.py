"""Scale mode of the simulation: many node agents hosted in one process."""
