# The two commands of the README:
#   make train   # installs what is missing, then trains MNIST on 2 ranks of this host
#   make test    # installs what is missing, then lint + the test suite but its slow scenarios
#   make test-slow   # the slow scenarios (pytest -m slow); CI (.ci/run) runs both
#   make test-fast   # the inner loop: lint + the tests that start no process (about 2 min)
# A second run only checks the installation (seconds): launch/setup_host.sh keeps a stamp.
#   TF_VERSION=2.15.1 make test   # the 2023 stack (TensorFlow 2.15.1, Python 3.11) in .venv-tf2.15.1
#   PYTHON=python3.12 make test   # that interpreter rather than the newest fitting one
#   make horovod-wheel WHEEL_DIR=dist   # the patched Horovod wheel alone (docs/horovod-wheel.md)

TF_VERSION ?= 2.21.0
VENV   ?= $(if $(filter 2.21.0,$(TF_VERSION)),.venv,.venv-tf$(TF_VERSION))
NP     ?= 2
EPOCHS ?= 15
OUT    ?= out/mnist
# The embedded digits by default; `make train HVDTRAIN_OFFLINE=0` lets Keras download MNIST.
HVDTRAIN_OFFLINE ?= 1
export HVDTRAIN_OFFLINE TF_VERSION
export HVDTRAIN_VENV := $(VENV)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup setup-test horovod-wheel train test test-slow test-fast test-gpu-image lint docs docs-serve reference clean image image-gpu

setup:
	@launch/setup_host.sh

setup-test:
	@launch/setup_host.sh --test

# The patched Horovod as a wheel in WHEEL_DIR, for any environment with this TensorFlow and
# Python (from the per-user cache, or built once: launch/install_horovod.sh).
WHEEL_DIR ?= dist
horovod-wheel: setup
	@PYTHON=$(VENV)/bin/python WHEEL_DIR=$(WHEEL_DIR) launch/install_horovod.sh

train: setup
	horovodrun -np $(NP) -H localhost:$(NP) python -m hvdtrain.mnist --epochs $(EPOCHS) \
	  --checkpoint-dir $(OUT) --metrics-json $(OUT)/metrics.json

lint: setup-test
	ruff check . && ruff format --check .

# The slow scenarios (kills and cuts over many runs, elastic, SLURM, namespace hosts, the Docker
# image, the benchmark's quick run) keep `make test` under 45 minutes here: `make test-slow`.
# TEST_WORKERS pytest processes (pytest-xdist) run the test files side by side, each file's tests
# in one of them (its shared jobs with it): the rank processes leave half of 2 cores idle alone.
TEST_WORKERS ?= 2
# Each run ends with its time and its slowest files (all of them in out/test-times.json), and
# warns past its budget (docs/development.md, "Where the time goes").
test: setup-test lint
	HVDTRAIN_TEST_BUDGET_SECONDS=1200 python -m pytest -m "not slow and not gpu_image" \
	  -n $(TEST_WORKERS) --dist loadfile

# The slow scenarios run test by test in TEST_WORKERS processes (a module's image, hosts or
# cluster kept in one: `xdist_group`; the longest first: tests/conftest.py), then the
# benchmark's quick runs (marker `alone`), which measure the machine, with nothing beside them.
# Both parts run; either failing fails.
test-slow: setup-test
	HVDTRAIN_TEST_BUDGET_SECONDS=720 python -m pytest -m "slow and not alone" -n $(TEST_WORKERS) \
	  --dist loadgroup; a=$$?; \
	python -m pytest -m "slow and alone"; b=$$?; [ $$a -eq 0 ] && [ $$b -eq 0 ]

# The tests that start no process (marker `processes`, set by tests/conftest.py from what each
# test calls): the inner loop while changing code; `make test` before a commit.
test-fast: setup-test lint
	HVDTRAIN_TEST_BUDGET_SECONDS=120 python -m pytest -m "not slow and not gpu_image and not processes"

# The docs site (mkdocs.yml, docs/): built into site/ with --strict (make test builds it too,
# in tests/test_docs.py), or served with live reload at http://127.0.0.1:8000.
docs: setup-test
	NO_MKDOCS_2_WARNING=1 mkdocs build --strict

docs-serve: setup-test
	NO_MKDOCS_2_WARNING=1 mkdocs serve

# docs/reference/api.md and flags.md written again from the code (readable in the repository;
# tests/test_docs.py fails when they are not what the code gives).
reference: setup-test
	python docs/hooks.py

# The GPU image built (cold: about 21 min) and checked on CPU; not in CI (docs/docker.md).
test-gpu-image: setup-test
	python -m pytest -m gpu_image

# The images (Dockerfile): CPU on a debootstrapped Debian 12 (root and debootstrap, or
# BASE_IMAGE=debian:bookworm-slim from a registry), GPU on a debootstrapped Debian 13 with
# TensorFlow's CUDA wheels (BASE_IMAGE=nvidia/cuda:...). BUILD_CA=/path/ca.crt:
# a CA the build trusts (a TLS-inspecting proxy), never kept in the image.
image:
	IMAGE=$(IMAGE) BASE_IMAGE=$(BASE_IMAGE) BUILD_CA=$(BUILD_CA) launch/docker_image.sh cpu

image-gpu:
	IMAGE=$(IMAGE) BASE_IMAGE=$(BASE_IMAGE) BUILD_CA=$(BUILD_CA) launch/docker_image.sh gpu

clean:
	rm -rf $(OUT) .pytest_cache site
