"""Fail fast: the layer every collective of gradsync goes through, below ``comm``, ``optim``,
``ddp`` and ``checkpoint``.

- ``deadline.py``: each collective waited for under gradsync's own deadline; a missing rank
  becomes :class:`~gradsync.errors.CollectiveTimeoutError` naming it, on every rank;
- ``arrivals.py``: where each rank was last seen (records in the c10d store), for those names;
- ``waiting.py``: how a rank waits (in slices: its record written once a wait lasts, a regroup
  looked for);
- ``liveness.py``: after a failure, which rank died (its process, a roll call in the store);
- ``group.py``: the private process group whose backend timeout is that deadline.

The per-step checks that use them (step tags, unused parameters, NaN/Inf, replica checksums)
are in ``gradsync/ddp/checks/``.
"""
