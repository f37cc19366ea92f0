# `make demo`: create .venv, install, and run the whole path on a built-in model.
# `make test`: create .venv if needed and run the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OUT := out
DEMO_MODEL := builtin:gpt
DEMO_ARGS := --model-arg vocab=8192 --model-arg layers=6 --model-arg dim=64

.PHONY: demo test install clean

install: $(STAMP)

# The CPU build of torch is pinned here (a plain `pip install torch` pulls a multi-GB CUDA build);
# pyproject.toml only asks for torch>=2.4, so GPU users keep their own build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p $(OUT)
	$(VENV)/bin/planner profile $(DEMO_MODEL) $(DEMO_ARGS) --micro-batch-sizes 1,2,4,8 --ranks-per-host 2 -o profiles/demo-gpt.json
	$(VENV)/bin/planner solve profiles/demo-gpt.json --stages 2 --global-batch 16 --memory-per-device 24MiB -o $(OUT)/plan.json
	$(VENV)/bin/planner compare profiles/demo-gpt.json --stages 2 --global-batch 16 --memory-per-device 24MiB
	$(VENV)/bin/runtime execute $(OUT)/plan.json --steps 6 --report $(OUT)/report.json --save-state $(OUT)/state.pt \
		--timeline $(OUT)/timeline.png
	$(VENV)/bin/planner check $(OUT)/plan.json $(OUT)/report.json

# Two pytest workers (pytest-xdist), a test file each at a time: most tests run one thread, so the
# second core would idle (CI: 2 cores). `make test TEST_WORKERS=0` runs the suite in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

clean:
	rm -rf $(OUT) profiles/demo-*.json .pytest_cache .hypothesis
