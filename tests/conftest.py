"""Hypothesis profiles: registered here so that ``--hypothesis-profile long`` can name one at start-up.

``ci`` is what ``tests/test_composition.py`` runs by default; ``long`` is for a long exploring run of it.
"""

from hypothesis import settings

settings.register_profile("ci", max_examples=200, stateful_step_count=25, deadline=None)
settings.register_profile("long", max_examples=5000, stateful_step_count=60, deadline=None)
