"""One cell identity: the axes and params of a cell are defined once (config/grid.py), and a
new axis added there reaches every place that names a cell: the cell's params (MLflow and
cells.csv), summary.json, the printed table, the read-back, the fit's selection order, the
unstable-cell list, the mode comparisons' matching and the diff's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hostsweep.config.grid import (
    CELL_AXES, CELL_PARAMS, ENGINE_AXES, INT_PARAMS, LOAD_AXES, OPTIONAL_PARAMS, build_cells,
)
from tests.conftest import compose_typed

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: the identity is patched before any module that names a cell
# is imported, as if the new axis had been written into config/grid.py. `seed` is a field
# of Cell that is not an axis today (measure.seed).
NEW_AXIS_SCRIPT = r'''
import json, sys
import hostsweep.config.grid as grid
grid.LOAD_AXES = (*grid.LOAD_AXES, "seed")
grid.CELL_AXES = (*grid.ENGINE_AXES, *grid.LOAD_AXES)
grid.CELL_PARAMS = (*grid.CELL_AXES, *grid.PROTOCOL_PARAMS, *grid.ENGINE_PARAMS)
from pathlib import Path
import pandas as pd
from hostsweep.measure.results import CellResult, cell_row
from hostsweep.measure.unstable import exclude_unstable
from hostsweep.record.celltable import CellTable
from hostsweep.record.read.readback import cell_params
from hostsweep.record.read.selection import in_grid_order
from hostsweep.report.modes import finished_cells, paired
from hostsweep.report.summary import cell_entry
from hostsweep.report.tables import table_columns
from hostsweep.compare.match import CELL_DIMS
from tests.conftest import compose_typed

cell = grid.build_cells(compose_typed(["+sku=cpu", "measure.seed=7"]))[0]
table = CellTable(Path(sys.argv[1]) / "cells.csv")
table.append(cell_row(CellResult(cell.key, cell.params(), "FINISHED", None, None), "run-1"))
table.flush()
header = (Path(sys.argv[1]) / "cells.csv").read_text().splitlines()[0].split(",")
row = {**cell.params(), "status": "FINISHED", "step_ms": 2.0}
rows = pd.DataFrame([{**row, "seed": seed, "mode": mode, "step_ms": ms, "run_id": f"r{seed}{mode}",
                      "stable": "false"} for seed in (1, 0) for mode, ms in (("eager", 2.0), ("graph", 1.0))])
runs = pd.DataFrame([{f"params.{k}": str(v) for k, v in row.items()}])
print(json.dumps({
    "params": "seed" in cell.params(), "cells.csv": "seed" in header,
    "summary.json": cell_entry(row)["params"].get("seed"),
    "table": "seed" in table_columns([row]),
    "read back": "seed" in cell_params(runs),
    "selection order": in_grid_order(rows)["seed"].tolist(),
    "unstable list": "seed" in exclude_unstable(rows)[1].left_out.columns,
    "mode pairs": len(paired(finished_cells(rows), "graph", "eager")),
    "diff matching": "seed" in CELL_DIMS,
}))
'''


def test_the_identity_is_engine_axes_then_load_axes_within_the_logged_params():
    assert CELL_AXES == (*ENGINE_AXES, *LOAD_AXES) and CELL_PARAMS[:len(CELL_AXES)] == CELL_AXES
    cell = build_cells(compose_typed(["+sku=cpu"]))[0]
    assert list(cell.params())[:len(CELL_PARAMS)] == list(CELL_PARAMS)
    assert all(isinstance(cell.params()[name], int) for name in INT_PARAMS)
    adaptive = build_cells(compose_typed(["+sku=cpu", "measure.target_ci_pct=2", "measure.replicates=3"]))[0]
    paired = ("side", "pair_against", "pair_design")
    assert list(adaptive.params()) == [*CELL_PARAMS, *(p for p in OPTIONAL_PARAMS if p not in ("target_mde_pct", *paired))]
    by_effect = build_cells(compose_typed(["+sku=cpu", "measure.target_mde_pct=5", "pair.enabled=true"]))[0]
    assert list(by_effect.params()) == [*CELL_PARAMS, *(p for p in OPTIONAL_PARAMS if p != "target_ci_pct")]


def test_a_new_axis_written_once_reaches_every_place_that_names_a_cell(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NEW_AXIS_SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reached = json.loads(proc.stdout.splitlines()[-1])
    assert reached == {"params": True, "cells.csv": True, "summary.json": 7, "table": True, "read back": True,
                       "selection order": [0, 1, 0, 1], "unstable list": True, "mode pairs": 2,
                       "diff matching": True}
