"""The simulator's studies as the recipe runs them: settings read from ``conf/sim``,
the experiments, their tables and plots, and the side by side with the paper."""
