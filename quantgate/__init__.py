"""quantgate's own layers around the stages: `quantgate.core` (the floor every stage stands
on), `quantgate.pipeline` (the order of stages) and `quantgate.cli` (the command line)."""
