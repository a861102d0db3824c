"""Benchmarks (`make bench`): scripts that print figures and ratios; never part of `make test`."""
