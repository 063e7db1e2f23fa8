"""Stops and resumes tried for real: ``preemption_loop`` (kill -9 at random moments, then the final
parameters against an uninterrupted run's) and ``resume_check`` (SIGTERM, resume, compare).
Results: ``results/reliability/``."""
