"""The bottom layer: errors, atomic hashed artifacts, validation, console and progress, model
resolution and the cache home, the stage cache. It imports no stage and nothing above it."""
