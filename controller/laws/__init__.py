"""Control laws of entropic-time inference as pure functions.

Nothing in this package imports Ray or vLLM: the laws are math, tested on their own,
and shared by the worker replicas (fast local loop) and the controller (global loop).
"""
