"""What the user reads: the run statistics store, the nodes' status lines, Preflight's verdicts
and their words."""
