"""Nightly sweep: every row of expectations.yaml (models x targets x quants) as one pytest case.

Run with ``make nightly`` (pytest-xdist spreads rows over workers). Each row runs
``nhil verify`` in a subprocess (``nhil.sweep.run_one``) and must end in its expected
outcome; the failure message carries the one-line reproducer with the row's seed.

Every worker logs its rows into one shared folder ``$NHIL_SWEEP_ROOT/<stamp>-nightly-<id>``
(default root ``runs/sweeps``; ``nhil.sweep.shared_sweep_dir``/``record_row``): a row is
logged INCOMPLETE when it starts and with its outcome when it ends, and the aggregated
reports (``report.html`` with the models x targets x quant matrix, ``matrix.md``,
``junit.xml``, ``summary.json`` with the wall time and the worker count) are rewritten
after every row.

``NHIL_MATRIX_ROWS`` selects rows: ``all`` (default), ``default`` (the rows without
``nightly: true``, i.e. what ``nhil sweep`` runs; ``nhil bench --matrix`` times these
with 1 and 2 workers), or comma-separated ids such as ``llama-tiny-sim-bf16``.
"""

import os
import uuid
from pathlib import Path

import pytest

from nhil import expectations
from nhil.sweep import pending_row, record_row, row_id, run_one, select_rows, shared_sweep_dir

_row_id = row_id  # model-target-quant[-variant]
ROWS = select_rows(expectations.load(), os.environ.get("NHIL_MATRIX_ROWS", "all"))
RUN_SEED = int(os.environ.get("NHIL_RUN_SEED", "0"))
# the same in every xdist worker of one run; a plain pytest run gets its own id
RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex


@pytest.fixture(scope="session")
def nightly_dir():
    return shared_sweep_dir(Path(os.environ.get("NHIL_SWEEP_ROOT", "runs/sweeps")), RUN_ID, rows_total=len(ROWS),
                            workers=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), run_seed=RUN_SEED)


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_matrix_row(row, nightly_dir):
    record_row(nightly_dir, pending_row(row, RUN_SEED))
    rep = run_one(row, RUN_SEED, nightly_dir, timeout_s=float(os.environ.get("NHIL_ROW_TIMEOUT", "5400")))
    record_row(nightly_dir, rep)
    assert rep["outcome"] == row["expect"], f"{rep['outcome']}: {rep.get('error', '')} -- reproduce: {rep['reproducer']}"
