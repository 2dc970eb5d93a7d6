# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# CI (.ci/run) also runs `make lint` and `make typecheck` (mypy, configured in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# What the tests need from the system, from Debian's packages: Chromium, which the dashboard's browser tests drive
# (Playwright's own browser download is not used), bubblewrap, the python grader's sandbox, and WordNet 3.0, the
# synonyms of text_similarity's meteor. Installed when missing, with apt-get: as root, else through sudo.
SYSTEM_TOOLS := /usr/bin/chromium /usr/bin/bwrap /usr/share/wordnet/data.noun
SYSTEM_PACKAGES := chromium bubblewrap wordnet-base
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: demo test system-tools sandbox-packages lint typecheck bench clean

# Two steps: the demo needs the service and the trainer (the train extra), the suite the test tools as well (dev).
TRAIN_STAMP := $(VENV)/.installed-train

$(TRAIN_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[train]'
	touch $(TRAIN_STAMP)

$(STAMP): $(TRAIN_STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,train]'
	# tinker-cookbook 0.6.1 (the Tinker API's end-to-end tests run its recipes) requires tml-renderers>=0.4.1, which
	# the package index does not have; it imports it only for Inkling and Kimi models. Its other requirements are in
	# the dev extra, so it is installed without them.
	$(PY) -m pip install -q -c constraints.txt --no-deps tinker-cookbook==0.6.1
	touch $(STAMP)

demo: $(TRAIN_STAMP)
	$(VENV)/bin/proxima demo

# The packages python graders import in their sandbox (trainer/grading/sandbox_packages/requirements.txt: OpenAI's
# grader image's), built for the sandbox's interpreter; rebuilt when the requirements change. About 10 s from nothing
# on a 2-core machine (its build script says why so fast). The sandboxes' unprivileged uids must be able to reach the
# folder, which a checkout under a folder only its owner can search (/root, a mktemp folder) is not: so it is built
# in SANDBOX_STORE, one folder per requirements' digest, and build/sandbox-packages, what PROXIMA_SANDBOX_PACKAGES
# defaults to (api/settings.py), links to it.
SANDBOX_PYTHON := /usr/bin/python3
SANDBOX_PACKAGES := build/sandbox-packages
SANDBOX_STAMP := $(SANDBOX_PACKAGES)/.built-from
SANDBOX_SOURCE := trainer/grading/sandbox_packages
SANDBOX_STORE ?= /var/tmp/proxima-sandbox-packages-$(shell id -u)
SANDBOX_DIGEST = $(shell cat $(SANDBOX_SOURCE)/requirements.txt $(SANDBOX_SOURCE)/build | sha256sum | cut -c1-16)

sandbox-packages: $(SANDBOX_STAMP)

$(SANDBOX_STAMP): $(SANDBOX_SOURCE)/requirements.txt $(SANDBOX_SOURCE)/build $(TRAIN_STAMP)
	PIP_PYTHON=$(PY) $(SANDBOX_SOURCE)/build $(SANDBOX_SOURCE)/requirements.txt $(SANDBOX_STORE)/$(SANDBOX_DIGEST) \
		$(SANDBOX_PYTHON)
	mkdir -p $(dir $(SANDBOX_PACKAGES)) && rm -rf $(SANDBOX_PACKAGES)
	ln -s $(SANDBOX_STORE)/$(SANDBOX_DIGEST) $(SANDBOX_PACKAGES)
	cp $(SANDBOX_SOURCE)/requirements.txt $@

# The suite in two pytest-xdist workers, whole test files each (module fixtures stay in one process), one torch
# thread each: both cores busy (one process kept them 65 % busy). The tests that measure wall-clock time are marked
# `alone` and run while the other worker waits (tests/xdist_alone.py). TEST_WORKERS=0 runs it in one process. Three
# workers were tried on 2 cores: 12.0 min, as two (the cores are full; each test only took longer).
TEST_WORKERS ?= 2

test: $(STAMP) system-tools $(SANDBOX_STAMP)
ifeq ($(TEST_WORKERS),0)
	$(PY) -m pytest -q
else
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
endif

system-tools: $(SYSTEM_TOOLS)

# One recipe for all of them (grouped targets): a fresh machine runs apt-get once.
$(SYSTEM_TOOLS) &:
	@command -v apt-get >/dev/null || { echo "missing $(SYSTEM_TOOLS): install $(SYSTEM_PACKAGES) (Debian names)"; exit 1; }
	@echo "installing $(SYSTEM_PACKAGES) with apt-get (the tests need $(SYSTEM_TOOLS))"
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES)
	@for f in $(SYSTEM_TOOLS); do [ -e "$$f" ] || { echo "$$f is still missing after apt-get install"; exit 1; }; done

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) bench/grpo_vs_trl.py

clean:
	rm -rf $(VENV) $(SANDBOX_PACKAGES) .pytest_cache .ruff_cache .mypy_cache
