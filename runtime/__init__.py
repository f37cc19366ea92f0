"""Pipeline-parallel runtime: executes a plan from `planner solve` on torch.distributed.

The runtime never imports the solver: a training cluster needs torch, not pulp.
"""
