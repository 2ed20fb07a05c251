"""The recipes' own code: Hydra settings, the training runner, the outputs it writes,
the comparison policies and the benchmark's helpers. The library imports none of it."""
