"""The checkpoint policies, one module each: MoEvement's sparse snapshots and the
baselines (Gemini, CheckFreq, MoC-System, MoEtion), each with its planner and its
restore rule, and :func:`make_planner` to build one by name."""
