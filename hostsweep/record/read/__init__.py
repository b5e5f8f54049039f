"""record.read: what was recorded, read back from MLflow; the rest of record/ writes it.

The measured-cell table the fit and compare stages work from (readback), the cells they
select (selection), the two sides of `stage=diff` (sides), and plain SELECTs on a
database store, which the tracker's resume reads use too (dbread).
"""
