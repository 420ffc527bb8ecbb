"""Stage 5: versioned gate policies, paired-bootstrap verdicts with the size and integrity
gates (`verdict`), `quantgate gate` and verdict records (`stage`), the ledger and the report."""
