# The two commands of the README. Each sets up .venv (once) and runs.
PY := .venv/bin/python
ARGS ?=

.PHONY: train test setup bench clean

setup:
	@scripts/bootstrap.sh

train: setup
	$(PY) -m jmamba.train_char_lm $(ARGS)

test: setup
	$(PY) -m pytest -q -n auto --dist loadfile $(ARGS)

clean:
	rm -rf .venv .pytest_cache runs
