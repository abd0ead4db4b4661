# Two entry points: `make train` (the main job) and `make test` (the suite CI runs).
# Both create .venv on first use; torch==2.13.0 resolves to the local CPU wheel on our machines.
VENV   := .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

.PHONY: train train-resize train-3d test lint docs gpu-check
# TRAIN_ARGS="--deterministic 4 --dtype float32": the deterministic mode, checked bit for bit.
TRAIN_ARGS ?=
train: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/train_gpt.py \
		--timeline runs/gpt/timeline.png $(TRAIN_ARGS)

# The world size changes mid-run: 3 ranks train to step 20 and stop (a node lost), 2 ranks
# resume from the checkpoint; the end is checked against 1 process, as in `make train`.
# RESIZE_ARGS="--dtype float32" runs it in float32.
RESIZE_OUT := runs/gpt-resize
RESIZE_ARGS ?=
train-resize: $(VENV)/.installed
	rm -rf $(RESIZE_OUT)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 3 examples/train_gpt.py --global-batches \
		--out $(RESIZE_OUT) --max-steps 40 --save-every 10 --stop-at 20 $(RESIZE_ARGS)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --global-batches \
		--out $(RESIZE_OUT) --max-steps 40 --save-every 10 $(RESIZE_ARGS)

# The same GPT on 8 ranks: data x context x tensor parallel (dp2 x cp2 x tp2).
train-3d: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node 8 examples/train_3d.py --cp 2 --tp 2

# The docs build and ruff come first (seconds): with --strict a broken link or anchor in docs/
# fails the suite, and the format check makes every line tests/unit/test_layout.py counts a
# line as the formatter writes it. Then two pytest processes, one per core: the torchrun jobs
# of tests/e2e (much of it waiting: grace periods, deadlines) beside everything else. mypy runs
# beside them at a lower priority: on a fresh clone, with no cache, it takes a minute or more
# of CPU, which the e2e stream's waits absorb. Its output and the e2e output follow the other
# stream's.
test: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks
	@types=$$(mktemp); log=$$(mktemp); nice -n 10 $(PY) -m mypy >$$types 2>&1 & mypy=$$!; \
	$(PY) -m pytest tests/e2e >$$log 2>&1 & e2e=$$!; \
	$(PY) -m pytest --ignore tests/e2e; rest=$$?; wait $$e2e; e2e_rc=$$?; wait $$mypy; mypy_rc=$$?; \
	echo "===== mypy ====="; cat $$types; echo "===== tests/e2e ====="; cat $$log; rm -f $$types $$log; \
	echo "exit codes: mypy $$mypy_rc, pytest tests/e2e $$e2e_rc, the rest $$rest"; \
	[ $$rest -eq 0 ] && [ $$e2e_rc -eq 0 ] && [ $$mypy_rc -eq 0 ]

lint: $(VENV)/.installed
	$(PY) -m ruff format --check src tests examples benchmarks

# The documentation site (mkdocs.yml, docs/) into site/; --strict turns every warning, such as a
# link to a missing page or anchor, into a failure.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Every CUDA claim checked on this machine's GPU in one run of at most 8 minutes on an H100
# (docs/gpu.md, "Checking it on a GPU"): writes benchmarks/gpu-check-<device>-<date>.md and .json
# and exits 1 if a check fails, 2 without CUDA. It needs no install: the lent GPU machines have a
# python3 with CUDA torch and no network, so gradsync runs from src/ with .venv's python where
# there is one, else python3. GPU_CHECK_ARGS="--out DIR", "--groups correctness syncs", "--dry"
# (the CPU wiring check that tests/dist/test_gpu_check_dry.py runs).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PY) benchmarks/gpu_check.py \
		$(GPU_CHECK_ARGS)
