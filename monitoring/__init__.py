"""Monitoring as code: Prometheus scrape config and Grafana dashboards generated to JSON."""
