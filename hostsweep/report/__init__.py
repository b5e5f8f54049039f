"""report: what a person reads. Tables and figures shared by the sweep summary and the
comparison stage, and what a finished sweep leaves (sweep_outputs: summary.json, figures,
the console's last lines). Pure (pandas, matplotlib); may import config, measure, record's
MLflow-free modules (the cell table, provenance, views) and model.
"""
