"""report: what a person reads. Tables and figures shared by the sweep summary and the
comparison stage, and what a finished sweep leaves (sweep_outputs: summary.json, figures,
the console's last lines). Pure (pandas, matplotlib): imports config, measure and model
only, never record/ (tests/unit/test_layout.py); what it writes to MLflow goes through the
tracker a stage hands it (sweep_outputs.RecordedSweep).
"""
