"""Worker replicas: one in-process vLLM engine each, with entropy-stabilized sampling."""
