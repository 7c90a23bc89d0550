"""The pieces of benchmarks/decoder_bench.py (the decoder benchmark, issue 42): one job per module."""
