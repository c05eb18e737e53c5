"""The analysis stage, pure (no torch, no processes): verdicts and their thresholds, the fp32
references, ranking, forensics summaries, and the run's probe table."""
