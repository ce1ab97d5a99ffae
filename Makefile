# make demo  - install what is missing, tune the built-in resnet18 on MLAS in fp32 and int8 under a
#              3% top-1 agreement budget (synthetic data), benchmark the plan against ONNX Runtime's fp32 default
# make test  - install what is missing, run the test suite
# make setup - the shared, idempotent install step

VENV := .venv
PYTHON := $(VENV)/bin/python
KSELECT := $(VENV)/bin/kselect
DEMO_DIR := .kselect-demo

.PHONY: setup demo test test-all clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/system-packages.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

demo: setup
	mkdir -p $(DEMO_DIR)
	$(KSELECT) tune resnet18 --library mlas --precision fp32,int8 --max-accuracy-drop 0.03 --budget 6 --min-time 0.05 \
		--db $(DEMO_DIR)/records.db -o $(DEMO_DIR)/resnet18.mlas.plan.json
	$(KSELECT) bench resnet18 --plan $(DEMO_DIR)/resnet18.mlas.plan.json --alone --rounds 6 --json $(DEMO_DIR)/resnet18.bench.json

test: setup
	$(PYTHON) -m pytest -q -m "not slow"

test-all: setup
	$(PYTHON) -m pytest -q

clean:
	rm -rf $(VENV) $(DEMO_DIR)
