"""Engine benchmarks: ratios against a baseline run in the same process, never timings alone."""
