"""The `planner` command (planner.cli.main)."""
