"""Sweeps past one machine: manifest rows as Ray tasks (``nhil sweep --ray``).

* ``resources``: what a row asks of a node (CPU, memory, ``rtl``, ``fpga_board:<name>``);
* ``golden_share``: goldens passed between workers by content (sha256 verified on read);
* ``ray_sweep``: the engine (:func:`~nhil.cluster.ray_sweep.ray_sweep`);
* ``bench``: the 1 vs 2 workers matrix row of ``nhil bench``.

Ray is the optional ``cluster`` extra (``pip install -e '.[cluster]'``, done by ``make
venv``); nothing here imports it until a Ray sweep is asked for.
"""

__all__ = ["ray_sweep", "row_resources"]


def __getattr__(name):
    if name == "ray_sweep":
        from nhil.cluster.ray_sweep import ray_sweep

        return ray_sweep
    if name == "row_resources":
        from nhil.cluster.resources import row_resources

        return row_resources
    raise AttributeError(name)
