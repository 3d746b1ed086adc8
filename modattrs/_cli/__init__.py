"""The command line, ``python -m modattrs``: ``inspect``, whose default model is ``modattrs.default_model``."""
