"""The orchestrator process: rollouts, advantages, the off-policy bound, packing, evals (ARCHITECTURE.md)."""
