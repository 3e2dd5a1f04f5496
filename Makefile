# The two commands of the README: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .install-stamp
# checkov (the policy scanner of tests/chart/test_checkov.py) pins many packages of its own
# (pydantic among them), so it lives in a virtualenv of its own instead of the project's environment.
CHECKOV_VENV := .venv-checkov
CHECKOV_VERSION := 3.3.30

.PHONY: install demo test test-fast test-real-node host-packages lab-build crd clean

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

# The demo: the lab cluster with its real kubelet node, the operator as the chart's Deployment, a LoRA job whose
# real trainer (a container of the trainer image) hits a GPU OOM, recovers and resumes from its checkpoint.
# As root (the node's runtime needs the host packages); without root the demo says to use
# `python -m e2e.demo --process-runner`. `python -m e2e.demo --fake-gpu` is the fast fake-GPU version.
demo: install
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory host-packages; fi
	$(PYTHON) -m e2e.demo

# Every test: fast unit tests and the end-to-end scenarios on the lab cluster (built on first use, cached).
# The tests without the lab on two workers, then the lab scenarios one at a time (each lab
# is heavy, and they share one session lab). worksteal: an idle worker takes queued tests from the
# other, so the long trainer runs do not end on one worker (319 s against 367-419 s measured).
test: install lab-build
	CHECKOV=$(CURDIR)/$(CHECKOV_VENV)/bin/checkov FINETUNE_LAB_REQUIRED=1 $(PYTHON) -m pytest -m "not e2e" -n 2 --dist worksteal
	FINETUNE_LAB_REQUIRED=1 $(PYTHON) -m pytest -m e2e

test-fast: install
	$(PYTHON) -m pytest -m "not e2e and not slow"

# The real kubelet node's scenarios (root): the host's container runtime from Debian, the node's
# binaries and both images built (cached), then the two opt-in modules, one lab at a time.
REAL_NODE_PACKAGES := containerd runc containernetworking-plugins iptables mmdebstrap umoci
host-packages:
	@missing=$$(for p in $(REAL_NODE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing; fi

test-real-node: install lab-build host-packages
	$(PYTHON) -m e2e.lab build --with kubelet
	$(PYTHON) -m e2e.lab images
	FINETUNE_LAB_REAL_NODE=1 FINETUNE_LAB_REQUIRED=1 flock /tmp/finetune-lab.lock $(PYTHON) -m pytest e2e/test_real_node.py e2e/test_real_node_training.py -s

lab-build:
	$(PYTHON) -m e2e.lab build

crd: install
	finetune-operator crd > crds/finetunejob.yaml
	cp crds/finetunejob.yaml charts/finetune-operator/crds/finetunejob.yaml

clean:
	rm -f $(STAMP)
