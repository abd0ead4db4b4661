"""Re-planning the buckets of a wrapper that is already training.

    autoplan.py     bucket_cap_mb="auto", pure half: cost model fit, simulated step, choice
    autotune.py     bucket_cap_mb="auto", runtime: ready-time profile, agreement, the switch
    unused_last.py  parameters a first step left unused on some rank, planned into the last bucket

Each hands the wrapper a new plan; the wrapper installs it (``Reducer.succeed``) between steps.
"""
