"""The realistic-noise simulator of benchmarks/gate_noise.py is what it claims (a stationary
AR(1) machine shared by an engine group, per-start instance offsets, the counterbalanced side
order of measure/protocol.py), and under it an A/A of paired rounds with a slow machine wander
(rho 0.9) keeps the gate's family-wise false-alarm rate at alpha (benchmarks/gate_realistic.py
prints the full table)."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from hostsweep.compare.stats import judge_rounds
from hostsweep.measure.protocol import side_a_first


@pytest.fixture(scope="module")
def G():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gate_noise.py"
    spec = importlib.util.spec_from_file_location("gate_noise", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gate_noise"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_the_machine_series_has_the_stated_autocorrelation_and_marginal_sd(G, rho):
    x = G.ar1(np.random.default_rng(int(rho * 10)), (4000,), 60, rho, 0.08)
    assert abs(float(x.std()) - 0.08) < 0.004
    assert abs(float(x[:, 0].std()) - 0.08) < 0.004  # stationary from its first value
    assert abs(G.lag1(x) - rho) < 0.02


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_paired_rounds_share_the_groups_machine_with_the_stated_round_to_round_rho(G, rho):
    """Instances, switch cost and pair noise off: what is left of a side's log step is the
    machine, the same law for every cell, its rounds rho apart, moving a group's cells together
    and other groups' not at all."""
    quiet = G.Noise(rho=rho, instance_sd=0.0, switch=0.0, pair_sd=1e-9, outlier_p=0.0)
    base, head = G.rounds_sides(np.random.default_rng(1), quiet, 1500, 30)
    x = np.log(base)
    assert abs(float(x.std()) - G.MACHINE_SD) < 0.005
    # a round's slots are shuffled, so a cell's gap to its next round varies about a round
    assert abs(G.lag1(x) - rho) < 0.04
    same_group, other_group = np.corrcoef(x[:, 0].ravel(), x[:, 1].ravel())[0, 1], \
        np.corrcoef(x[:, 0].ravel(), x[:, 4].ravel())[0, 1]
    assert same_group > rho - 0.05 and abs(other_group) < 0.03


def test_each_engine_start_is_an_instance_shared_by_its_groups_cells_with_the_stated_sd(G):
    only = G.Noise(rho=0.0, machine_sd=0.0, switch=0.0, pair_sd=1e-9, outlier_p=0.0)
    base, head = G.starts_sides(np.random.default_rng(2), only, 3000, 3)
    level = np.log(base[..., 0])  # (studies, cells, starts): one value per start
    assert np.allclose(level[:, :4], level[:, :1], atol=1e-6)  # the cells of a group share it
    assert abs(float(level[:, ::4].std()) - G.INSTANCE_SD) < 0.0005
    assert abs(np.corrcoef(level[:, 0, 0], level[:, 0, 1])[0, 1]) < 0.06  # a new instance each start
    b, h = G.rounds_sides(np.random.default_rng(3), only, 3000, 8)
    d = np.log(h / b)[:, ::4, 0]  # one instance a side and group: the ratio's SD is sqrt(2) of it
    assert abs(float(d.std()) - math.sqrt(2) * G.INSTANCE_SD) < 0.0007


def test_the_simulated_side_order_is_the_protocols(G):
    k, slot = np.meshgrid(np.arange(16), np.arange(6), indexing="ij")
    assert (G.counterbalanced(k, slot) == np.vectorize(side_a_first)(k, slot)).all()


@pytest.mark.parametrize("order, leans", [("counterbalanced", False), ("old_order", True)])
def test_a_switch_cost_biases_the_rounds_only_with_the_old_side_order(G, order, leans):
    switch_only = G.Noise(rho=0.0, machine_sd=0.0, instance_sd=0.0, pair_sd=1e-9, outlier_p=0.0)
    base, head = G.rounds_sides(np.random.default_rng(4), switch_only, 200, 40, order=getattr(G, order))
    lean = np.abs(np.log(head / base).mean(axis=(0, 2)))
    assert (lean.min() > 0.4 * G.SWITCH) if leans else (lean.max() < 0.1 * G.SWITCH), lean


def test_a_paired_rounds_aa_under_a_slow_machine_wander_keeps_the_family_wise_rate_at_alpha(G):
    """16 cells in 4 groups, 40 rounds, rho 0.9, machine SD 8 %, instances 1 %, the switch cost,
    skewed pair noise with outliers: any cell `slower` in at most alpha + 3 standard errors of
    1000 A/As."""
    studies, alpha = 1000, 0.05
    base, head = G.rounds_sides(np.random.default_rng(5), G.Noise(rho=0.9), studies, 40)
    v = judge_rounds(base, head, 5.0, alpha)
    fwer = float((v == "slower").any(axis=1).mean())
    assert fwer <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / studies), fwer
