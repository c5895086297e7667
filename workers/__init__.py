"""Worker replicas: one vLLM engine each, in the process of the replica's core, with entropy-stabilized sampling."""
