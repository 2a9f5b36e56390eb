# Every target that needs the project creates .venv when missing and installs
# the project with its test extras; a stamp file makes re-runs instant.  The
# install compiles the C hot path (wire/skan/_codec_speedups.c, see setup.py) in
# place, so a change to it re-runs the install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench lint venv clean fuzz

$(STAMP): pyproject.toml setup.py wire/skan/_codec_speedups.c broker/_observer_speedups.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[analytics,test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/skan-broker $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check broker wire toolkit clients analytics tests bench
	$(PY) -m pytest $(PYTEST_ARGS)

# The long fuzz run (minutes): SKAN_FUZZ_EXAMPLES inputs (default 2000) per
# decoder and per listener of a real broker; prints the inputs tried and the
# findings.  `make test` runs the same suite briefly (30 inputs per target).
# Then every other property and differential test at its full example count
# (`make test` runs a quarter of it: tests/examples.py).
fuzz: $(STAMP)
	SKAN_FUZZ=long $(PY) -m pytest tests/fuzz -p no:cacheprovider -rxX \
		--hypothesis-show-statistics $(PYTEST_ARGS)
	SKAN_FUZZ=long $(PY) -m pytest tests -m property --ignore=tests/fuzz \
		-p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.run $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check broker wire toolkit clients analytics tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
