"""The benchmarks the README and docs cite (benchmarks/README.md); shared helpers in `common`.

Each script runs as `python -m benchmarks.<name>` or `python benchmarks/<name>.py` from the
repository root.
"""
