"""The plan file: what `planner solve` writes and the runtime executes."""
