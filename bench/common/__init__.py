"""Code the measurement scripts share: timing and CSV (harness), the benchmark models (models), peak memory in a
fresh process (memory_probe). The scripts run with bench/ on sys.path and import `common.<module>`."""
