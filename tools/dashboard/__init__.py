"""The live dashboard: racks of trays coloured by ComputeDomain, fed by store watches."""
