"""Shared test configuration: hypothesis profiles.

`HYPOTHESIS_PROFILE=ci` (set by .ci/run) runs several times more examples than the default
profile a developer gets locally.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
