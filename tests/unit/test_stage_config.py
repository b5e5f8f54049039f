"""One config for a whole study: several models in one sweep (cell keys unchanged), the
calibration as a Hydra group, `stage=` checked, and stage=all's checks of the fit on the
planned grid, all before anything starts."""
from __future__ import annotations

import pytest

from hostsweep.config.grid import build_cells
from hostsweep.config.schema import ConfigError
from hostsweep.stages.all import check_plan
from tests.conftest import compose_typed


def test_models_list_sweeps_every_model_and_keeps_each_cells_key():
    both = compose_typed(["+sku=cpu", "models=[tiny-llama,small-llama]", "tp=[1,2]"])
    alone = compose_typed(["+sku=cpu", "model=small-llama", "tp=[1,2]"])
    cells = build_cells(both)
    assert {c.engine.model for c in cells} == {"tiny-llama", "small-llama"} and len(cells) == 2 * len(build_cells(alone))
    assert {c.key for c in build_cells(alone)} <= {c.key for c in cells}


@pytest.mark.parametrize("overrides,needle", [
    (["models=[tiny-llama,huge-llama]"], "unknown model 'huge-llama' in models"),
    (["models=[small-llama,tiny-llama]", "tp=3"], "tp=3 does not divide the 8 attention heads of model tiny-llama"),
    (["stage=report"], "stage='report' is not allowed; allowed: sweep, fit, compare, all, diff, noise$"),
])
def test_bad_study_lists_and_stages_are_one_line_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        compose_typed(["+sku=cpu", *overrides])


def test_the_calibration_group_composes_typed_terms():
    study = compose_typed(["+experiment=tp70b", "calibration=seed002-h100"])
    calibration = study.config.calibration
    assert calibration.allreduce["h100"].latency_us == 21.2 and calibration.host.s0_ms == 16.9
    assert compose_typed(["+sku=cpu"]).config.calibration is None


def test_the_cpu_preset_plans_a_fit_on_tp1_with_tp2_held_out():
    study = compose_typed(["+experiment=generalize-cpu"])
    keys = check_plan(study)
    assert len(keys) == 2 * 2 * 3 * 2 and study.config.fit.train_tp == [1]


@pytest.mark.parametrize("overrides,needle", [
    (["split.enabled=false"], "fit.host=cells fits H(N) to TP-1 split cells of sku cpu"),
    (["tp=[2]", "fit.train_tp=null"], "fit: nothing is held out"),
    (["tp=[2]"], "fit.train_tp=[1] has no cells of sku cpu; its TP degrees: 2"),
    (["fit.mode=graph"], "fit.mode=graph has no cells in the selection"),
    (["fit.g_mode=free"], "fit.g_mode 'free' is not one of pinned, joint"),
    (["compare.fit_run=abc"], "compare.fit_run does not apply to stage=all"),
])
def test_stage_all_refuses_a_study_it_could_not_compare_before_sweeping(overrides, needle):
    study = compose_typed(["+experiment=generalize-cpu", *overrides])
    with pytest.raises(ConfigError) as error:
        check_plan(study)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_the_tp_study_preset_trains_on_h100_and_takes_h_from_the_calibration():
    with pytest.raises(ConfigError, match="fit.train_sku is required: the selection spans SKUs h100, h200"):
        check_plan(compose_typed(["+experiment=tp70b", "fit.train_sku=null", "calibration=seed002-h100"]))
    with pytest.raises(ConfigError, match="fit.host=cells fits H"):  # no TP-1 cells: H must come from a calibration
        check_plan(compose_typed(["+experiment=tp70b"]))
    study = compose_typed(["+experiment=tp70b", "calibration=seed002-h100"])
    assert len(check_plan(study)) == 48 and study.config.fit.train_sku == "h100"


def test_a_host_line_negative_over_the_measured_batches_is_reported():
    import pandas as pd

    from hostsweep.model.fit import HostFit
    from hostsweep.model.study_fit import CalibrationTerms
    from hostsweep.calibrate.terms import FixedTerms, _check_host

    cells = pd.DataFrame({"batch": [1, 2, 4]})
    falling = FixedTerms(CalibrationTerms({}, HostFit(0.005, -0.002)), {})
    _check_host(falling, cells)
    (warning,) = falling.warnings
    assert "H(N) is negative at N = 4 (-1.00 ms)" in warning
    flat = FixedTerms(CalibrationTerms({}, HostFit(0.005, 0.0)), {})
    _check_host(flat, cells)
    assert flat.warnings == []
