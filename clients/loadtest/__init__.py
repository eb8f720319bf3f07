"""Load-test client (python -m clients.loadtest): workloads, load generation, metrics, reports."""
