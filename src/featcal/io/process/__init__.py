"""The running process: SIGTERM as a flag, the host allocator's settings, which optional extras are installed.

The lowest floor of io/: reading and writing both stop on the interrupt flag, and nothing here reads or writes
a checkpoint.
"""
