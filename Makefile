# The two commands of the README: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .install-stamp
# checkov (the policy scanner of tests/chart/test_checkov.py) pins many packages of its own
# (pydantic among them), so it lives in a virtualenv of its own instead of the project's environment.
CHECKOV_VENV := .venv-checkov
CHECKOV_VERSION := 3.3.30

.PHONY: install demo test test-fast test-real-node host-packages lab-build lab-binaries crd clean

# torch first, then the rest without build isolation, so that DeepSpeed builds against
# the torch already installed instead of downloading another copy into an isolated env.
$(STAMP): pyproject.toml
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet torch
	$(PIP) install --quiet --no-build-isolation -e '.[dev]'
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet checkov==$(CHECKOV_VERSION)
	touch $(STAMP)

install: $(STAMP)

# The demo: the lab cluster with its two real kubelet nodes, the operator as the chart's Deployment, a LoRA job
# whose real trainer (a container of the trainer image) hits a GPU OOM, recovers and resumes from its checkpoint.
# As root (the nodes' runtime needs the host packages); without root the demo says to use
# `python -m e2e.demo --fake-gpu`, the fast fake-GPU version.
demo: install
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory host-packages; fi
	$(PYTHON) -m e2e.demo

# The real kubelet nodes' scenarios need root (containerd, kubelets, a CNI bridge: host-wide state the lab
# records and puts back). As root, `make test` installs the host's container runtime from Debian when
# missing, builds the nodes' binaries and both images (cached) and runs those scenarios with the rest;
# without root they are skipped, and pytest says so.
ROOT := $(shell [ "$$(id -u)" = 0 ] && echo 1 || echo 0)
REAL_NODE_PACKAGES := containerd runc containernetworking-plugins iptables mmdebstrap umoci

# Every test: fast unit tests and the end-to-end scenarios on the lab cluster (built on first use, cached).
# The tests without the lab on two workers (worksteal: an idle worker takes queued tests from the
# other, so the long trainer runs do not end on one worker). Then, at the same time, the real nodes'
# scenarios in one pytest process (their trainer containers use the CPUs; their two modules share one
# lab, e2e/conftest.py real_node_lab, and two such labs cannot run at once) and the other lab
# scenarios on two xdist workers (mostly waiting on their labs; loadfile: a module's tests on one
# worker, each worker with its own session lab); the real nodes' output follows the others'.
# The images (only the real nodes' scenarios run them) build in the background while the tests
# without the lab run: a change to the copied code rebuilds their last layers, about 45 s that
# otherwise come before every test.
REAL_NODE_TESTS := e2e/test_real_node.py e2e/test_real_node_training.py
test: install lab-binaries
	@images_log=$$(mktemp /tmp/finetune-images.XXXXXX); \
	if [ "$(ROOT)" = 1 ]; then $(PYTHON) -m e2e.lab images > $$images_log 2>&1 & images=$$!; else images=; fi; \
	CHECKOV=$(CURDIR)/$(CHECKOV_VENV)/bin/checkov FINETUNE_LAB_REQUIRED=1 $(PYTHON) -m pytest -m "not e2e" -n 2 --dist worksteal; fast=$$?; \
	images_rc=0; if [ -n "$$images" ]; then wait $$images; images_rc=$$?; fi; \
	echo "== the images, built beside the tests above:"; cat $$images_log; rm -f $$images_log; \
	[ $$fast = 0 ] && [ $$images_rc = 0 ]
	@log=$$(mktemp /tmp/finetune-real-node-tests.XXXXXX); \
	FINETUNE_LAB_REAL_NODE=$(ROOT) FINETUNE_LAB_REQUIRED=1 $(PYTHON) -m pytest -m e2e $(REAL_NODE_TESTS) > $$log 2>&1 & real=$$!; \
	FINETUNE_LAB_REQUIRED=1 $(PYTHON) -m pytest -m e2e -n 2 --dist loadfile $(addprefix --ignore=,$(REAL_NODE_TESTS)); rest=$$?; \
	wait $$real; real_rc=$$?; \
	echo "== the real nodes' scenarios (e2e/test_real_node*.py), run beside the others:"; cat $$log; rm -f $$log; \
	[ $$rest = 0 ] && [ $$real_rc = 0 ]

test-fast: install
	$(PYTHON) -m pytest -m "not e2e and not slow"

# Only the real nodes' scenarios (root).
test-real-node: install lab-build
	FINETUNE_LAB_REAL_NODE=1 FINETUNE_LAB_REQUIRED=1 flock /tmp/finetune-lab.lock $(PYTHON) -m pytest $(REAL_NODE_TESTS) -s

host-packages:
	@missing=$$(for p in $(REAL_NODE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing; fi

# The lab's binaries from their Go modules (cached; S3 server, JobSet, Trainer v2 and Kueue included) and,
# as root, the host packages, the real nodes' binaries and both images. The images (mmdebstrap and pip:
# mostly the network and the disk) build while Go compiles (the CPU): on a fresh machine that hides
# most of their minutes.
lab-build: install
	@set -e; if [ "$(ROOT)" = 1 ]; then \
		$(MAKE) --no-print-directory host-packages; \
		$(PYTHON) -m e2e.lab images & images=$$!; \
		$(PYTHON) -m e2e.lab build --with kubelet || { kill $$images; exit 1; }; \
		wait $$images; \
	else \
		$(PYTHON) -m e2e.lab build; \
		echo "not root: the real kubelet nodes' scenarios will be skipped"; \
	fi

# The same without the images (`test` builds them beside its first stage).
lab-binaries: install
	@set -e; if [ "$(ROOT)" = 1 ]; then \
		$(MAKE) --no-print-directory host-packages; \
		$(PYTHON) -m e2e.lab build --with kubelet; \
	else \
		$(PYTHON) -m e2e.lab build; \
		echo "not root: the real kubelet nodes' scenarios will be skipped"; \
	fi

crd: install
	finetune-operator crd > crds/finetunejob.yaml
	cp crds/finetunejob.yaml charts/finetune-operator/crds/finetunejob.yaml

clean:
	rm -f $(STAMP)
