# make demo  - install what is missing, tune the built-in resnet18 on MLAS in fp32 and int8 under a
#              3% top-1 agreement budget (synthetic data), benchmark the plan against ONNX Runtime's fp32 default;
#              then on oneDNN with every precision this CPU has (--precision all: bf16 on a CPU with AVX512_BF16
#              or AMX; the tune names each precision the CPU lacks and why), benchmarked the same way
# make test  - install what is missing, run the test suite
# make setup - the shared, idempotent install step
# make test-arm64 - the arm64 subset, every program an aarch64 one: in a Debian 13 arm64 root under qemu
#              user-mode emulation (scripts/arm64-root.sh, needs root; built once: 6-12.5 min, 312 MB), `make setup`
#              there (7-27 min the first time, 2.8 GB), then ARM64_TESTS. Its timings are emulated:
#              correctness and installability only

VENV := .venv
PYTHON := $(VENV)/bin/python
KSELECT := $(VENV)/bin/kselect
DEMO_DIR := .kselect-demo

# the arm64 subset: emulation detection and labels (kselect plugins --json), the ACL release, the ACL runner built
# natively with g++ (its arm_gemm kernels forced through 24.11's API) and every ACL test file, the contract suite on every library available there (MLAS, ACL 24.11, XNNPack 2024, oneDNN 3.7),
# XNNPack's public API and f32 GEMM micro-kernel choice on the 2024 build, oneDNN's 3.x C API (operators /
# implementations against numpy, a resnet18 tune and whole-model run) and MLAS's fp16 (ONNX Runtime's float16 kernels)
ARM64_TESTS := tests/test_arm64.py tests/test_acl_runner.py tests/test_acl_library.py tests/test_acl_model.py \
               tests/test_acl_int8.py tests/test_acl_int8_model.py \
               tests/test_contract.py tests/test_xnnpack_both_apis.py tests/test_xnnpack_arm64_ukernels.py \
               tests/test_onednn_both_apis.py tests/test_mlas_fp16.py

.PHONY: setup demo test test-all test-arm64 clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/system-packages.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

demo: setup
	mkdir -p $(DEMO_DIR)
	$(KSELECT) tune resnet18 --library mlas --precision all --max-accuracy-drop 0.03 --budget 6 --min-time 0.05 \
		--db $(DEMO_DIR)/records.db -o $(DEMO_DIR)/resnet18.mlas.plan.json
	$(KSELECT) bench resnet18 --plan $(DEMO_DIR)/resnet18.mlas.plan.json --alone --rounds 6 --json $(DEMO_DIR)/resnet18.bench.json
	$(KSELECT) tune resnet18 --library onednn --precision all --max-accuracy-drop 0.03 --budget 2 --min-time 0.05 \
		--db $(DEMO_DIR)/records.db -o $(DEMO_DIR)/resnet18.onednn.plan.json
	$(KSELECT) bench resnet18 --plan $(DEMO_DIR)/resnet18.onednn.plan.json --alone --rounds 6 \
		--json $(DEMO_DIR)/resnet18.onednn.bench.json

test: setup
	$(PYTHON) -m pytest -q -m "not slow" --durations=25  # the slowest tests: the suite must stay under 20 minutes

test-all: setup
	$(PYTHON) -m pytest -q

test-arm64:
	scripts/arm64-root.sh run -- make setup
	scripts/arm64-root.sh run -- $(PYTHON) -m pytest -q $(ARM64_TESTS)

clean:
	rm -rf $(VENV) $(DEMO_DIR)
