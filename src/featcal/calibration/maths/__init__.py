"""The pure math of FeatCal, floor 1 of calibration/ (docs/layout.md): the streaming statistics (statistics.py),
their sums over ranks (distributed.py: RankGroup all-reduces a task's sums before it is normalised), the drift
sums a run records (drift.py), and the closed-form solves (solver.py; solves.py solves a block's modules)."""
