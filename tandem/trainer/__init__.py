"""The trainers: RL (`rl/`) and SFT (`sft/`) over shared parts (model, parallelism, loss, checkpoints)."""
