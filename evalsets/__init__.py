"""Stage 4: versioned golden sets and the evaluator (issue 5; not built yet)."""
