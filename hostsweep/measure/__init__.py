"""measure: from raw timings and profiler traces to numbers. Differencing with bootstrap
CIs, trace parsing, the device/host split, thread states, and the result types a worker
returns (CellResult) with the metrics every recorder derives from them.

Pure: numpy and pandas only; may import hostsweep.config, nothing below it.
"""
