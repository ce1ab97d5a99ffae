"""The configuration-space schema: enumeration with conditions and constraints, counting,
sampling, stable keys and cost-model features."""

import json
import random

from kselect.core.contract.space import Categorical, Integer, Space, WorkloadSplit, config_key


def acl_like_space(k=8, n=64) -> Space:
    space = Space()
    space.add(Categorical("method", ("GEMM", "WINOGRAD", "DIRECT"), role="algorithm"))
    space.add(Categorical("kernel", ("sgemm_12x8", "hybrid_16x4", "smallK_4x8"), role="micro-kernel", when={"method": ["GEMM"]}))
    space.add(Categorical("fast_math", (False, True), when={"method": ["WINOGRAD"]}))
    space.add(Categorical("layout", ("NHWC", "NCHW"), role="layout"))
    space.add(Integer("threads", 1, 2))
    space.add(WorkloadSplit("split", granularity=4, parts_from="threads"))
    space.constrain(f"smallK kernels need K <= 8 and N % 4 == 0 (K={k}, N={n})",
                    lambda c: c.get("kernel") != "smallK_4x8" or (k <= 8 and n % 4 == 0))
    return space


def test_enumeration_applies_conditions_and_counts():
    space = acl_like_space()
    configs = space.enumerate()
    # threads=1: one split; threads=2: quarters 1/4..3/4 (3) plus the even split, which is 2/4.
    per_layout_and_method = 1 + 3
    assert len(space) == (3 + 2 + 1) * 2 * per_layout_and_method
    assert all("kernel" in c for c in configs if c["method"] == "GEMM")
    assert not any("kernel" in c for c in configs if c["method"] != "GEMM")
    assert not any("fast_math" in c for c in configs if c["method"] != "WINOGRAD")
    assert all(abs(sum(c["split"]) - 1.0) < 1e-9 and len(c["split"]) == c["threads"] for c in configs)
    assert len({config_key(c) for c in configs}) == len(configs)


def test_constraint_removes_configs():
    allowed = acl_like_space(k=8, n=64)
    refused = acl_like_space(k=64, n=64)
    assert any(c.get("kernel") == "smallK_4x8" for c in allowed.enumerate())
    assert not any(c.get("kernel") == "smallK_4x8" for c in refused.enumerate())
    assert len(allowed) - len(refused) == 2 * 4


def test_keys_are_stable_and_survive_json():
    space = acl_like_space()
    config = space.enumerate()[-1]
    stored = json.loads(json.dumps(config))
    assert config_key(stored) == config_key(config)
    assert space.normalise(stored) == config
    assert config_key({"b": 1, "a": 2}) == config_key({"a": 2, "b": 1})


def test_sampling_stays_in_the_space():
    space = acl_like_space(k=64)
    keys = {config_key(c) for c in space.enumerate()}
    samples = space.sample(random.Random(1), 200)
    assert all(config_key(c) in keys for c in samples)
    assert len({config_key(c) for c in samples}) > len(keys) // 2


def test_encoding_has_fixed_width_and_distinguishes_configs():
    space = acl_like_space()
    vectors = [tuple(space.encode(c)) for c in space.enumerate()]
    assert {len(v) for v in vectors} == {len(space.feature_names())}
    assert len(set(vectors)) == len(vectors)


def test_dimension_must_follow_what_it_depends_on():
    space = Space()
    try:
        space.add(Categorical("kernel", ("a",), when={"method": ["GEMM"]}))
    except ValueError as exc:
        assert "method" in str(exc)
    else:
        raise AssertionError("a condition on a missing dimension was accepted")
