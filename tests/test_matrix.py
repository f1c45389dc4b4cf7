"""Nightly sweep: every row of expectations.yaml (models x targets x quants) as one pytest case.

Run with ``make nightly`` (pytest-xdist spreads rows over workers). Each row runs
``nhil verify`` in a subprocess (``nhil.sweep.run_one``) and must end in its expected
outcome; the failure message carries the one-line reproducer with the row's seed.
"""

import os

import pytest

from nhil import expectations
from nhil.sweep import run_one

ROWS = expectations.load()
RUN_SEED = int(os.environ.get("NHIL_RUN_SEED", "0"))


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[f"{r['model']}-{r['target']}-{r['quant']}" for r in ROWS])
def test_matrix_row(row, tmp_path):
    rep = run_one(row, RUN_SEED, tmp_path, timeout_s=float(os.environ.get("NHIL_ROW_TIMEOUT", "5400")))
    assert rep["outcome"] == row["expect"], f"{rep['outcome']}: {rep.get('error', '')} -- reproduce: {rep['reproducer']}"
