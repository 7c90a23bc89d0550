"""`featcal bench`: experts, base and merges alone and + FeatCal on the offline zoo."""

from featcal.experiments.bench.run import BenchSettings, run_bench, write_bench

__all__ = ["BenchSettings", "run_bench", "write_bench"]
