"""Supervised fine-tuning (`tandem sft`)."""
