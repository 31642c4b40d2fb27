"""`cdctl`: inspect domains, members, nodes, cliques, reservations and IMEX daemons in the store."""
