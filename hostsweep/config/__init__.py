"""config: what a study asks for. The Hydra schema (dataclasses, one ConfigStore block),
the shipped options under conf/, the one-time resolution and validation of a sweep config,
model shapes, what this machine is, and the grid of cells.

Pure: imports only Hydra/OmegaConf and the standard library. Every package below may
import it; it imports no other hostsweep package.
"""
