"""The comparison engine (pure: no Ray, MLflow or vLLM): two sides of measured cells matched,
compared cell by cell under the design each was measured in (sequential, paired engine
starts, paired rounds), judged with Holm over the cells, summed up, and gated. report/ renders
what it returns; stages/diff.py wires it to the runs it reads. compare/cellwise.py states the rules.
"""
from hostsweep.compare.cellwise import COLUMNS, compare_quantity, diff
from hostsweep.compare.match import CELL_DIMS, PROVENANCE_DIMS, Difference, cell_label, dimensions, match_cells, text
from hostsweep.compare.options import (DESIGNS, FAIL_ON, GATED, HOST_FIXED, MIN_ROUNDS, NO_BETWEEN, NORMALIZE, PAIRED,
                                       PAIRED_HOST, PAIRED_ROUNDS, PAIRED_ROUNDS_HOST, POINT, RAW, SIDES, SUMMARY, TESTS, VERDICTS,
                                       DiffOptions, diff_options, stable_flag, step_unstable)
from hostsweep.compare.result import DiffResult
from hostsweep.compare.rounds import MatchedRounds, match_rounds
from hostsweep.compare.floors import floor_text
from hostsweep.compare.start_pairs import NoiseFloor, paired_noise_floor
from hostsweep.compare.summary import comparison_design, geometric_mean

__all__ = ["CELL_DIMS", "COLUMNS", "DESIGNS", "FAIL_ON", "GATED", "HOST_FIXED", "MIN_ROUNDS", "NO_BETWEEN", "NORMALIZE", "PAIRED",
           "PAIRED_HOST", "PAIRED_ROUNDS", "PAIRED_ROUNDS_HOST", "POINT", "PROVENANCE_DIMS", "RAW", "SIDES", "SUMMARY",
           "TESTS", "VERDICTS", "DiffOptions", "DiffResult", "Difference", "MatchedRounds", "NoiseFloor", "cell_label",
           "compare_quantity", "comparison_design", "diff", "diff_options", "dimensions", "floor_text",
           "geometric_mean", "match_cells", "match_rounds", "paired_noise_floor", "stable_flag", "step_unstable",
           "text"]
