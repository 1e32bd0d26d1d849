"""The RL trainer process (`tandem trainer`)."""
