"""run: where measurements happen. Ray cluster connection and feasibility, TP placement,
process hygiene of worker processes, the worker actor, fault-tolerant dispatch, progress.

Side effects live here (Ray, processes, signals). May import config, measure and engines;
never record, model or report.
"""
