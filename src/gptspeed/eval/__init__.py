"""Evaluations beyond val loss: :mod:`.hellaswag`."""
