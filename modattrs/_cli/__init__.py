"""The command line, ``python -m modattrs``: the ``inspect`` command and the model it inspects by default."""
