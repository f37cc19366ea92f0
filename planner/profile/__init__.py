"""What was measured: the profile file, and the measurements behind `planner profile`."""
