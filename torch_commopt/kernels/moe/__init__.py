"""Mixture-of-experts with expert parallelism: the token exchange and its schedules."""
