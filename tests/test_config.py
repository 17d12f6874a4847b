"""hot.Config: a frozen, validated dataclass."""
import dataclasses

import pytest

import hot


def test_defaults():
    c = hot.Config()
    assert (c.gx_bits, c.rank, c.rounding, c.gx_scale, c.exact) == (8, 16, "stochastic", "tensor", False)
    p = hot.Config.paper()
    assert (p.gx_bits, p.rank, p.rounding, p.gx_scale, p.exact) == (4, 8, "stochastic", "tensor", False)
    assert hot.Config.paper(rank=4).rank == 4 and "HLA rank 8" in p.describe() and "full rank" in c.describe()


@pytest.mark.parametrize("field,value,allowed", [
    ("gx_bits", 3, "4 or 8"), ("gx_bits", 16, "4 or 8"), ("rank", 0, "1..16"), ("rank", 17, "1..16"),
    ("rank", 2.0, "1..16"), ("rounding", "floor", "'stochastic' or 'nearest'"),
    ("gx_scale", "row", "'tensor' or 'token'"), ("exact", "yes", "True or False"),
], ids=lambda v: str(v))
def test_invalid_fields(field, value, allowed):
    with pytest.raises(ValueError) as e:
        hot.Config(**{field: value})
    msg = str(e.value)
    assert field in msg and allowed in msg and repr(value) in msg


def test_frozen_replace_and_dict_round_trip():
    c = hot.Config(gx_bits=8, rank=4, rounding="nearest", gx_scale="token", exact=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 2
    d = c.replace(rank=16)
    assert d.rank == 16 and c.rank == 4 and d.gx_bits == 8
    assert hot.Config.from_dict(c.to_dict()) == c
    assert c.to_dict() == {"gx_bits": 8, "rank": 4, "rounding": "nearest", "gx_scale": "token", "exact": False}
    with pytest.raises(ValueError, match="rank"):
        c.replace(rank=99)
    with pytest.raises(ValueError, match="unknown fields.*bogus"):
        hot.Config.from_dict({"bogus": 1})
