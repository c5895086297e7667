"""deployments.ray_metrics: a histogram mirrored into Ray must keep every bucket's count, so each value it
observes again must fall in the bucket it stands for."""
from __future__ import annotations

import bisect
import math

from hypothesis import given
from hypothesis import strategies as st

from deployments.ray_metrics import bucket_value, ray_metric_name


@given(bounds=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=12, unique=True).map(sorted))
def test_each_bucket_value_falls_in_its_own_bucket(bounds):
    uppers = [*bounds, math.inf]
    for i in range(len(uppers)):
        assert bisect.bisect_left(uppers, bucket_value(uppers, i)) == i  # bucket i: uppers[i-1] < v <= uppers[i]


def test_names_are_sanitized_as_vllm_sanitizes_them_for_ray():
    assert ray_metric_name("vllm:time_to_first_token_seconds") == "vllm_time_to_first_token_seconds"
    assert ray_metric_name("entropic_token_entropy_nats") == "entropic_token_entropy_nats"
