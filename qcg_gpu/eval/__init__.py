"""Evaluation: datasets, metrics, the harness, variants, run files, plots, significance, bench."""
