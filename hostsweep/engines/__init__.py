"""engines: one module per inference engine behind one interface (base.Engine), chosen by
`engine.name` through the registry in hostsweep.config and imported lazily, so
`import hostsweep` works on a machine without vLLM.

May import hostsweep.config and hostsweep.measure.
"""
