"""report: what a person reads. Tables and figures shared by the sweep summary and the
comparison stage. Pure (pandas, matplotlib); may import config, measure and model.
"""
