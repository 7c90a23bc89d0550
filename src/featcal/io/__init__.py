"""Checkpoint reading, atomic output writing and run reports."""
