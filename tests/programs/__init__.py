"""Real training programs, written as their libraries' users write them, run under scalify.

One module per program (model, data and training step in the idioms of its library),
``harness`` (the checks: float32 invariance, FP16 and FP8 training against FP32) and
``recipe`` (the one place that says how a user turns a program into a scalified one).
"""
