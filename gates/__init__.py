"""Stage 5 and the glue: gates, verdicts, the ledger, the report, the pipeline and the CLI.

Also home to what every stage shares: the error family (`gates.errors`) and atomic,
hashed artifacts (`gates.artifacts`). Importing this package imports nothing heavy.
"""
