"""Data parallelism: the naive reference (``naive``) and the overlapped wrapper (``wrapper``).

The public names are exported once, by the ``gradsync`` package itself.
"""
