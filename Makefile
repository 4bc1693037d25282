# The two commands of the README. Each sets up .venv (once) and runs.
PY := .venv/bin/python
ARGS ?=

.PHONY: train test test-slow setup bench clean

setup:
	@scripts/bootstrap.sh

train: setup
	$(PY) -m jmamba.train_char_lm $(ARGS)

# The default tier; `make test-slow` runs the rest (tests/conftest.py SLOW_TESTS). CI runs both.
test: setup
	$(PY) -m pytest -q -n auto --dist loadfile -m "not slow" $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -n auto --dist loadfile -m slow $(ARGS)

clean:
	rm -rf .venv .pytest_cache runs
