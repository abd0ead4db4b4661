"""``make gpu-check``: every CUDA claim of gradsync checked on a real GPU in one prepared run.

The entry point is ``benchmarks/gpu_check.py``; each module here holds one group of checks:

- ``correctness.py``: one process against world size 1 on NCCL, a serialised run of the same
  (``CUDA_LAUNCH_BLOCKING=1``: no stream can overtake another) and 2 gloo ranks on the one GPU,
  for every communication path (``modes.py``), each next to torch DDP with the same feature;
- ``syncs.py``: the host syncs of a step under ``torch.cuda.set_sync_debug_mode("error")``,
  with the allow-list of the reads that stay and why;
- ``overlap.py``: ``torch.profiler`` traces: bucket collectives during backward, exposed
  communication;
- ``speed.py``: step time against torch DDP and with the step timeline on and off, eager and
  ``torch.compile``, a GPT of 100M+ parameters in bf16 autocast;
- ``deadline.py``: the CUDA-event deadline raises ``CollectiveTimeoutError`` before NCCL's
  watchdog.

``common.py`` holds what they share (the check record, the time budget, the small GPT with a
slow backward kernel); ``report.py`` writes the markdown and JSON report. ``--dry`` runs every
group on CPU gloo ranks with tiny models, so the code cannot rot between GPU lendings
(``tests/dist/test_gpu_check_dry.py``).
"""
