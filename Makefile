# One task runner for developers, the README and CI (.ci/run calls these targets).
PYTHON ?= python3
export HYPOTHESIS_PROFILE ?= default

.PHONY: install test lint rust-test loom ci demo bench

## Build the Rust extension (release) and install the package with test and lint tools.
install:
	$(PYTHON) -m pip install -e ".[dev]"

## The README's test command: install, then run the whole Python suite.
test: install
	$(PYTHON) -m pytest

## Rust unit and integration tests of the core (no Python needed).
rust-test:
	cargo test --workspace

## Long Rust stress tests (`#[ignore]`d in the default run), in release: their own CI step.
# (its own .PHONY line, beside it, so it is one self-contained addition)
.PHONY: rust-stress
rust-stress:
	cargo test -p prefixkv-core --release -- --ignored

## loom model of the take-reference / release / evict race (own target dir: other cfg).
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p prefixkv-core --test loom_pool --release

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PYTHON) -m ruff check python tests benches
	$(PYTHON) -m ruff format --check python tests benches
	$(PYTHON) -m mypy.stubtest prefixkv._core

## Everything CI runs, with the CI hypothesis profile (more examples).
ci: export HYPOTHESIS_PROFILE = ci
ci: test rust-test loom lint

demo:
	$(PYTHON) -m pip install . && prefixkv demo

bench:
	$(PYTHON) -m pip install -e ".[bench]" && $(PYTHON) benches/run.py
