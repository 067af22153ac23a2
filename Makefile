# One task runner for developers, the README and CI (.ci/run calls these targets).
PYTHON ?= python3
export HYPOTHESIS_PROFILE ?= default

.PHONY: install test lint rust-test rust-stress loom ci demo bench no-extras free-threaded release vllm-test

## Build the Rust extension (release) and install the package with test and lint tools.
install:
	$(PYTHON) -m pip install -e ".[dev]"

## The README's test command: install (and redis-server for the KV tier tests, from Debian
## packages if it is missing), then run the whole Python suite.
test: install
	scripts/install_redis.sh
	$(PYTHON) -m pytest

## Rust unit and integration tests of the core (no Python needed), and a build of
## benches/core_profile (its own crate, the profiling harness; it has no tests of its own since
## its run-table stand-in moved into the core as `run_cache`).
rust-test:
	cargo test --workspace
	cargo test --manifest-path benches/core_profile/Cargo.toml

## Long Rust stress tests (`#[ignore]`d in the default run), in release: their own CI step.
rust-stress:
	cargo test -p prefixkv-core --release -- --ignored

## loom models of the real cache: lock-free lookups racing release / evict / refill and
## set_context, refcount ownership checked; and of the run table's sequence locks, readers
## racing truncate / split / replace / reuse (own target dir: another cfg).
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p prefixkv-core --test loom_pool --release
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p prefixkv-core --test loom_runs --release

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PYTHON) -m ruff check python tests benches scripts
	$(PYTHON) -m ruff format --check python tests benches scripts
	$(PYTHON) -m mypy python/prefixkv
	$(PYTHON) -m mypy.stubtest prefixkv._core

## Everything CI runs, with the CI hypothesis profile: more examples, drawn from a seed derived
## from the commit (fresh each commit, the same on a rerun; the pytest header prints it, and
## `--hypothesis-seed=N` replays it: tests/hypothesis_profiles.py).
ci: export HYPOTHESIS_PROFILE = ci
ci: test rust-test loom lint

demo:
	$(PYTHON) -m pip install ".[demo]" && prefixkv demo

bench:
	$(PYTHON) -m pip install -e ".[bench]" && $(PYTHON) benches/run.py

## What `pip install prefixkv` gives an engine: the wheel, installed without extras into a fresh
## venv, has no torch, and the block manager and `prefixkv analyze` work there. Reuses target/.
NO_EXTRAS_VENV ?= .venv-no-extras
no-extras:
	rm -rf dist/no-extras "$(NO_EXTRAS_VENV)"
	$(PYTHON) -m pip wheel --quiet --no-deps . -w dist/no-extras
	$(PYTHON) -m venv "$(NO_EXTRAS_VENV)"
	"$(NO_EXTRAS_VENV)/bin/python" -m pip install --quiet dist/no-extras/prefixkv-*.whl
	@if "$(NO_EXTRAS_VENV)/bin/python" -m pip show --quiet torch 2>/dev/null; then \
		echo "no-extras: torch was installed without being asked for" >&2; exit 1; fi
	"$(NO_EXTRAS_VENV)/bin/python" scripts/smoke_no_extras.py

## The free-threaded build (no GIL, so no abi3: a version-specific wheel): a free-threaded
## CPython 3.13 built from Debian's source package into FREE_THREADED_PREFIX (once; kept there),
## prefixkv's wheel for it, and the block manager's tests run on it with the GIL checked off.
FREE_THREADED_PREFIX ?= .free-threaded-python
free-threaded:
	python="$$(scripts/build_free_threaded_python.sh "$(FREE_THREADED_PREFIX)")" && \
		scripts/free_threaded_check.sh "$$python"

## Release artifacts for this platform, each checked: abi3 manylinux wheel (auditwheel), sdist
## (built from alone), `cargo package` of prefixkv-core. See docs/release.md.
release:
	PYTHON=$(PYTHON) scripts/release.sh

## vLLM integration (docs/vllm.md): a venv holding vLLM's CPU build (scripts/install_vllm.sh,
## idempotent), prefixkv installed into it from this checkout, the SmolLM2 checkpoint
## (scripts/prepare_smollm2.py), then tests/vllm (vLLM's own scheduler against the stock
## block manager, the connector on a real redis-server) and the two end-to-end runs on the real
## model: scheduler_cls against stock vLLM, and the connector across two processes.
VLLM_VENV ?= .venv-vllm
# Inside the venv folder: ignored by git, removed with the venv.
VLLM_MODEL ?= $(VLLM_VENV)/smollm2-hf
vllm-test:
	scripts/install_vllm.sh "$(VLLM_VENV)"
	"$(VLLM_VENV)/bin/python" -m pip install --quiet -e .
	"$(VLLM_VENV)/bin/python" scripts/prepare_smollm2.py "$(VLLM_MODEL)"
	OMP_NUM_THREADS=1 "$(VLLM_VENV)/bin/python" -m pytest tests/vllm
	OMP_NUM_THREADS=1 "$(VLLM_VENV)/bin/python" scripts/vllm_e2e_scheduler.py --model "$(VLLM_MODEL)" --expect full
	OMP_NUM_THREADS=1 "$(VLLM_VENV)/bin/python" scripts/vllm_e2e_scheduler.py --model "$(VLLM_MODEL)" --expect full --core blocks
	"$(VLLM_VENV)/bin/python" scripts/prepare_tiny_windowed.py "$(VLLM_VENV)/tiny-sliding" --kind sliding --tokenizer "$(VLLM_MODEL)"
	OMP_NUM_THREADS=1 "$(VLLM_VENV)/bin/python" scripts/vllm_e2e_scheduler.py --model "$(VLLM_VENV)/tiny-sliding" --prompt-repeats 3 --expect sliding
	"$(VLLM_VENV)/bin/python" scripts/prepare_tiny_windowed.py "$(VLLM_VENV)/tiny-hybrid" --kind hybrid --tokenizer "$(VLLM_MODEL)"
	OMP_NUM_THREADS=1 "$(VLLM_VENV)/bin/python" scripts/vllm_e2e_scheduler.py --model "$(VLLM_VENV)/tiny-hybrid" --prompt-repeats 3 --expect hybrid
	OMP_NUM_THREADS=1 PYTHONPATH=. "$(VLLM_VENV)/bin/python" scripts/vllm_e2e_connector.py --model "$(VLLM_MODEL)"
