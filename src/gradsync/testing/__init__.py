"""Harnesses for tests, tools and benchmarks: not needed to train with gradsync.

``spawn`` runs a function on N local gloo ranks, on fresh processes or on the long-lived
workers of ``pool`` (the test session opens one); ``netns`` and ``cluster`` simulate several
nodes on one Linux machine (network namespaces, shaped links) and launch torchrun on them;
``busbw`` times all-reduces for bus bandwidth; ``gpt`` and ``corpus`` are the small model and
generated text of the main job, ``gradsync verify`` and the benchmarks. ``import gradsync``
never imports this package.
"""
