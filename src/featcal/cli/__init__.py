"""The `featcal` command line: one sub-module per sub-command, each exposing `register(subparsers)`."""
