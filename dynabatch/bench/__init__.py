"""Benchmarks behind `dynabatch bench ...`: each prints a table and ratios against baselines run in the same process."""
