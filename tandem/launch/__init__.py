"""Launchers: `tandem rl` runs the three processes locally; Slurm rendering comes later."""
