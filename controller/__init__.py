"""Central entropy controller and the pure control laws it shares with the workers."""
