"""Ray Serve applications: the OpenAI-compatible ingress and the app builders."""
