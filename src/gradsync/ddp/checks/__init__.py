"""What the wrapper checks, so that a mistake raises the same error on every rank instead of a
hang or silent divergence (the deadline they wait under is in ``gradsync/failfast/``).

At construction:
    model.py        every rank holds the same parameters, buffers and settings
    diagnostics.py  replica checksums, the first batches are not all identical, ``any_rank``
After every step, from what rode along in the buckets:
    tags.py         each rank's position in its training loop (step tags)
    readout.py      the step's readout: flags, tags, NaN flags, item count in one device read
    verdicts.py     the verdicts: desync, changed parameters, missing counts, unused, NaN/Inf
    param_watch.py  what changed in the module after wrapping
"""
