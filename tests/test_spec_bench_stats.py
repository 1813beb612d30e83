"""bench/spec_bench.py's paired confidence interval (the 3% gate's statistic)."""
import math

import numpy as np

from bench.spec_bench import paired_ci95


def test_paired_ci95():
    g, lo, hi = paired_ci95([1.0, 1.0, 1.0])
    assert g == lo == hi == 1.0
    g, lo, hi = paired_ci95([0.9, 1.1, 1.0, 0.95, 1.05])
    assert lo < g < hi and lo < 1.0 < hi
    logs = np.log([0.9, 1.1, 1.0, 0.95, 1.05])
    half = 2.78 * logs.std(ddof=1) / math.sqrt(5)           # t(0.975, 4)
    assert math.isclose(hi, math.exp(logs.mean() + half), rel_tol=1e-9)
    assert paired_ci95([0.8])[2] == float("inf")              # one rep: no interval
    _, _, hi = paired_ci95([0.90, 0.91, 0.89, 0.90, 0.92, 0.90])   # a consistent 10% loss
    assert hi < 0.97
