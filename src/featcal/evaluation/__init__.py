"""Evaluation: the metrics and runners of `featcal eval` (featcal.evaluate), used by bench and reproduce too.

Above merging and calibration (it scores what they produce), below the experiments (which score
through it). `featcal.evaluate` is the entry point (evaluation/api.py).
"""
