"""attnserve's locust users, where locust users look for them.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000

The users, their traffic shapes and their settings (ATTNSERVE_LOADTEST_* variables) live in
`attnserve.loadtest.locustfile`; `attnserve loadtest` (`make loadtest`) runs them over a ladder of
user counts and writes its results under loadtest/results/.
"""

from attnserve.loadtest.locustfile import (
    BatchTranslation,
    LongTranslation,
    MixedTraffic,
    ShortTranslation,
    StreamingGeneration,
    TrafficUser,
)

__all__ = [
    "BatchTranslation",
    "LongTranslation",
    "MixedTraffic",
    "ShortTranslation",
    "StreamingGeneration",
    "TrafficUser",
]
