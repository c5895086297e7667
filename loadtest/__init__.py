"""Load tests (Locust) and benchmark harnesses; results go to docs/."""
