"""What featcal writes: atomic output folders, the featcal.json report, the model card, task heads, tokenizers.

The top floor of io/: an output is made from what was read (io/read/), so writing imports reading, never the
other way round.
"""
