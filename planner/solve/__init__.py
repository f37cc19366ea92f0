"""Solvers for the pipeline plan (the only package that imports pulp): planner.solve.api.solve is the
entry; the integer program, the exact chain DP, the brute-force oracle and the baselines other tools
use are all judged by planner.cost.model."""
