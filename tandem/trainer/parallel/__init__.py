"""Parallelism applied as functions over a single-device model: FSDP2, activation checkpointing."""
