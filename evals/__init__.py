"""kvpress evaluations: RULER-style tasks, LongBench, needle-in-a-haystack, a runner that shares one prefill
across policies and ratios, and the `kvpress-eval` CLI."""
