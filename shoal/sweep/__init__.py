"""``shoal bench``: scaling sweeps of ``shoal train`` runs next to a hand-written PyTorch DDP loop.

:mod:`~shoal.sweep.spec` reads ``--strategies``; :mod:`~shoal.sweep.config` holds the sweep's
settings and its points; :mod:`~shoal.sweep.runner` runs them (locally or on an emulated
cluster); :mod:`~shoal.sweep.measure` turns each run's records into numbers;
:mod:`~shoal.sweep.tables` writes them out; :mod:`~shoal.sweep.reference` is the DDP loop.
"""
