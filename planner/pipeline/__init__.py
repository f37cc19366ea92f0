"""What a plan runs, as data: schedule lists, topology and their simulation (no torch, no pulp)."""
