"""Deferred init's engine: recording construction on fake tensors and replaying it on real ones."""
