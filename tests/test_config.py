"""hot.Config: the core's hot::Config bound to Python, immutable, validated by the core."""
import copy
import dataclasses
import pickle

import numpy as np

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


def test_is_the_core_config():
    """hot.Config is the bound C++ hot::Config (a subclass adding only Python conveniences), what hot._C takes."""
    c = hot.Config(rank=4, gx_scale="token")
    assert isinstance(c, hot._C.Config)
    assert repr(c) == "Config(gx_bits=8, rank=4, rounding='stochastic', gx_scale='token', exact=False)"
    assert c == hot.Config(rank=4, gx_scale="token") and c != hot.Config() and c != "Config" and hash(c) == hash(
        hot.Config(rank=4, gx_scale="token"))
    assert len({hot.Config(), hot.Config(), hot.Config.paper()}) == 2
    assert not hasattr(c, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        del c.rank


def test_pickle_and_copy():
    c = hot.Config.paper(rounding="nearest", exact=True)
    for d in (pickle.loads(pickle.dumps(c)), copy.copy(c), copy.deepcopy(c)):
        assert type(d) is hot.Config and d == c


def test_code_round_trip_and_errors():
    """The one-integer encoding the torch custom ops carry (hot::Config::code), produced and parsed by the core."""
    seen = set()
    for bits in (4, 8):
        for rank in range(1, 17):
            for rounding in ("stochastic", "nearest"):
                for scale in ("tensor", "token"):
                    for exact in (False, True):
                        c = hot.Config(gx_bits=bits, rank=rank, rounding=rounding, gx_scale=scale, exact=exact)
                        d = hot.Config.from_code(c.code)
                        assert type(d) is hot.Config and d == c and 0 <= c.code < 4096
                        seen.add(c.code)
    assert len(seen) == 256
    for bad in (-1, 4096, 8):  # 8: gx_bits 8 with rank 0
        with pytest.raises(ValueError, match=f"Config.from_code: .*{bad}"):
            hot.Config.from_code(bad)


def test_numpy_scalars_and_field_order():
    c = hot.Config(gx_bits=np.int64(4), rank=np.int32(8), exact=np.bool_(True))
    assert (c.gx_bits, c.rank, c.exact) == (4, 8, True) and type(c.rank) is int and type(c.exact) is bool
    with pytest.raises(ValueError, match="exact must be True or False, got np.int64"):
        hot.Config(exact=np.int64(1))
    # several invalid fields: the first in declaration order is reported, as the dataclass did
    with pytest.raises(ValueError, match="gx_bits"):
        hot.Config(gx_bits=3, rank=0, rounding="floor")
    with pytest.raises(ValueError, match="rank"):
        hot.Config(rank=0, rounding="floor")
