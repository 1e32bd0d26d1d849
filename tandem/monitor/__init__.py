"""Metrics, progress and the run report."""
