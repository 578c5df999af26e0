"""Log-probabilities (dense, replay, hybrid) and losses."""
