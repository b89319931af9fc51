# Shortcuts over the scripts; each script sets up .venv itself.
.PHONY: quickstart test bench bench-quick

quickstart:
	bash scripts/quickstart.sh

test:
	bash scripts/test.sh

bench:
	bash scripts/bench.sh

bench-quick:
	BENCH_QUICK=1 BENCH_OUT=work/bench-quick bash scripts/bench.sh
