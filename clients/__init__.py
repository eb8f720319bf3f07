"""Clients of the service: streaming client and load tester."""
