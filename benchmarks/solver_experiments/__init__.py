"""Solver experiments that no solve path uses, kept for the benchmarks that run them:
fold.py (leaves folded into their neighbours, benchmarks/solver_tb2_settings.py),
lagrange.py (a Lagrangian lower bound, benchmarks/solver_iopddl.py) and tb2_options.py
(toulbar2 settings chosen per request, benchmarks/solver_tb2_settings.py).
measurements.md holds the one-off runs behind the solver's design choices."""
