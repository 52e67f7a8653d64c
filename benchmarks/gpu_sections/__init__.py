"""The sections of benchmarks/gpu_suite.py, one module each (common.py and report.py: what they share)."""
