"""Hydra config tree for hostsweep, shipped in the wheel as ``hostsweep.conf``."""
