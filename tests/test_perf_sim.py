"""The simulator's fast paths equal what they replace (issue 31): the in-memory backend's
memoised input sums and a stream's last token, computed without the row before it."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from gateway.backends import memory
from gateway.backends.memory import VOCAB

ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64)


@given(ids)
def test_memoised_raw_sum_is_numpys(values: list[int]) -> None:
    raw = np.array(values, dtype=np.int32).tobytes()
    expected = int(np.frombuffer(raw, dtype=np.int32).sum(dtype=np.int64))
    assert memory._raw_sum(raw) == expected
    assert memory._raw_sum(bytes(raw)) == expected  # a hit (equal content, another object)


@given(ids, ids)
def test_input_sum_reads_the_last_tensor_named(first: list[int], last: list[int]) -> None:
    request = service_pb2.ModelInferRequest()
    for values in (first, last):
        request.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, len(values)])
        request.raw_input_contents.append(np.array(values, dtype=np.int32).tobytes())
    request.inputs.add(name="OTHER", datatype="INT32", shape=[1])
    assert memory._input_sum(request, "INPUT_IDS") == sum(last)


@given(st.integers(0, VOCAB - 1), st.integers(-2, 5000))
def test_last_token_is_the_rows_last(seed: int, count: int) -> None:
    row = memory._tokens(seed, max(count, 0))
    assert memory._last_token_bytes(seed, count) == row[-1:].tobytes()
