"""The worker's split through the fake engine: several profiled pairs pooled with CIs, and a
planted implausible split profiled again, then flagged, never shown as a host fraction. (The
profiler-overhead band and the other checks are tested on planted numbers in test_split_stats.py:
the fake's timings are as noisy as the machine.)"""
from __future__ import annotations

import dataclasses

from hostsweep.measure.results import cell_metrics, cell_row
from hostsweep.record.recorder import describe
from tests.unit.test_stability import counting_worker, fake_study


def test_three_profiled_pairs_give_the_split_its_cis_and_a_regime(tmp_path):
    cells, options = fake_study("measure.replicate_first=false", "batch=[1]", "split.reps=3")
    worker, _ = counting_worker(tmp_path, cells[0].engine)
    result = worker.measure(cells[0], options)
    split = result.split
    assert split.pairs == 3 and split.device_ci[0] <= split.device_ms <= split.device_ci[1]
    assert split.regime in ("host-bound", "device-bound", "undetermined")
    assert split.regime != "undetermined" or split.host_frac_ci is None or \
        split.host_frac_ci[0] < options.split.host_bound_threshold <= split.host_frac_ci[1]
    assert 0 < split.device_floor_ms <= split.device_ci[1]  # the fake's ops: at their floor, not below
    assert split.implausible == () and "split_implausible" not in result.stability.reasons
    metrics = cell_metrics(result)
    assert metrics["split_pairs"] == 3 and "device_ci_low_ms" in metrics and "device_floor_ms" in metrics
    # host_frac's CI needs the step clearly above 0 at the level; the fake's 4 noisy pairs may not give that
    assert ("host_frac_ci_low" in metrics) == (split.host_frac_ci is not None)


def test_a_split_below_its_floor_is_profiled_again_then_flagged_implausible(tmp_path, monkeypatch):
    import hostsweep.run.profiling as worker_module  # the split's half of the worker

    real_split = worker_module.device_split

    def below_floor(*args, **kwargs):  # every pair's device time a tenth of what its kernels need
        split = real_split(*args, **kwargs)
        return dataclasses.replace(split, device_floor_ms=split.device_ms * 10)

    monkeypatch.setattr(worker_module, "device_split", below_floor)
    cells, options = fake_study("measure.replicate_first=false", "batch=[1]", "split.reps=3",
                                "measure.remeasure_unstable=1")
    worker, _ = counting_worker(tmp_path, cells[0].engine)
    profiled_before = worker._profile_count
    result = worker.measure(cells[0], options)
    assert worker._profile_count - profiled_before == 6  # 3 in the rounds, 3 more after
    assert result.split.implausible == ("device_below_floor",) and result.split.possible
    assert "split_implausible" in result.stability.reasons and not result.stability.stable
    metrics = cell_metrics(result)
    assert "device_ms" in metrics and not {"host_frac", "host_ms", "attributed_frac"} & set(metrics)
    assert "regime" not in cell_row(result, "run")
    assert "no host_frac (implausible: device_below_floor)" in describe(result)
