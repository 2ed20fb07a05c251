"""Parallel execution primitives: pipeline stages with a boundary hook, expert dispatch,
and the plans that split a user's model into stages and expert shards."""
