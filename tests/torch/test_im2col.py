"""hot.torch.ops.im2col / col2im against torch's F.unfold / F.fold over conv geometries (columns in hot's (i, j, c)
order, F.unfold's (c, i, j) permuted): im2col is pure data
movement (exactly equal); col2im equals F.fold exactly where windows do not overlap and within float32 summation
error where they do (16-bit dtypes accumulate in float32, as F.fold does)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import DEVICES
from hot.torch.ops import col2im, im2col

# (N, C, H, W, kh, kw, stride, padding, dilation)
GEOMS = [
    (2, 3, 9, 9, 3, 3, (1, 1), (1, 1), (1, 1)),   # ResNet 3x3
    (2, 4, 8, 8, 3, 3, (2, 2), (1, 1), (1, 1)),   # strided 3x3
    (2, 3, 32, 32, 16, 16, (16, 16), (0, 0), (1, 1)),  # patch embedding (k == s)
    (3, 5, 7, 6, 1, 1, (1, 1), (0, 0), (1, 1)),   # 1x1
    (2, 5, 7, 7, 1, 1, (2, 2), (0, 0), (1, 1)),   # 1x1 stride 2 (downsample)
    (1, 2, 11, 10, 7, 7, (2, 2), (3, 3), (1, 1)),  # ResNet stem
    (2, 3, 10, 12, 3, 2, (1, 3), (2, 0), (2, 1)),  # asymmetric, dilated
    (1, 2, 9, 9, 2, 2, (3, 3), (0, 0), (1, 1)),   # stride > kernel: gaps, rows/cols never read
    (1, 1, 5, 5, 5, 5, (1, 1), (0, 0), (1, 1)),   # one output position
]
IDS = [f"N{g[0]}C{g[1]}_{g[2]}x{g[3]}_k{g[4]}x{g[5]}_s{g[6][0]}{g[6][1]}_p{g[7][0]}{g[7][1]}_d{g[8][0]}{g[8][1]}"
       for g in GEOMS]


def _cij_to_ijc(cols, C, k):
    """Columns in F.unfold's (c, i, j) order -> hot's (i, j, c) order."""
    return cols.reshape(cols.shape[0], C, k[0], k[1]).permute(0, 2, 3, 1).reshape(cols.shape[0], -1)


def _ijc_to_cij(cols, C, k):
    return cols.reshape(cols.shape[0], k[0], k[1], C).permute(0, 3, 1, 2).reshape(cols.shape[0], -1)


def _unfold_ref(x, k, s, p, d):
    N, C = x.shape[:2]
    u = F.unfold(x, k, dilation=d, padding=p, stride=s)  # N x CKK x P, columns (c, i, j)
    return _cij_to_ijc(u.transpose(1, 2).reshape(N * u.shape[2], u.shape[1]), C, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_im2col_equals_unfold(geom, layout, device):
    N, C, H, W, kh, kw, s, p, d = geom
    g = torch.Generator().manual_seed(N * 100 + C * 10 + H)
    base = torch.randn(N, C, H, W + 3, generator=g)
    x = base[..., 1:W + 1] if layout == "sliced" else base[..., :W].contiguous()
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    x = x.to(device)
    cols = im2col(x, (kh, kw), s, p, d)
    ref = _unfold_ref(x.contiguous(), (kh, kw), s, p, d)
    assert cols.is_contiguous() and cols.shape == ref.shape
    assert torch.equal(cols, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_col2im_equals_fold(geom, dtype, device):
    N, C, H, W, kh, kw, s, p, d = geom
    x = torch.zeros(N, C, H, W)
    L, CKK = _unfold_ref(x, (kh, kw), s, p, d).shape
    g = torch.Generator().manual_seed(L + CKK)
    cols = torch.randn(L, CKK, generator=g).to(dtype).to(device)
    out = col2im(cols, (N, C, H, W), (kh, kw), s, p, d)
    # reference in float64 from the same (rounded) inputs, in F.fold's (c, i, j) column order
    P = L // N
    cf = _ijc_to_cij(cols.double(), C, (kh, kw))
    ref = F.fold(cf.reshape(N, P, CKK).transpose(1, 2), (H, W), (kh, kw), dilation=d, padding=p, stride=s)
    # the engine's map is channels-last
    assert out.dtype == dtype and out.shape == (N, C, H, W) and out.is_contiguous(memory_format=torch.channels_last)
    overlap = s[0] < d[0] * (kh - 1) + 1 or s[1] < d[1] * (kw - 1) + 1
    if not overlap:
        assert torch.equal(out.double(), ref)  # each element is one input value (or zero): exact
    else:
        # float32 sums of at most kh*kw terms, then one rounding to dtype
        terms = kh * kw
        mag = F.fold(cf.abs().reshape(N, P, CKK).transpose(1, 2), (H, W), (kh, kw), dilation=d,
                     padding=p, stride=s)
        eps_out = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
        bound = terms * 2.0 ** -24 * mag + eps_out * ref.abs() + 1e-30
        assert ((out.double() - ref).abs() <= bound).all()


def _patch_perm(N, Ho, Wo):
    """Row indices into (n, ho, wo)-ordered rows that list each image's 4 x 4 patches, patches in raster order and
    the rows of a patch in raster order (written out here with loops, independently of ops._patch_split)."""
    idx = []
    for n in range(N):
        for ph in range(Ho // 4):
            for pw in range(Wo // 4):
                for i in range(4):
                    for j in range(4):
                        idx.append((n * Ho + 4 * ph + i) * Wo + 4 * pw + j)
    return torch.tensor(idx)


# geometries whose output map tiles into 4 x 4 patches: (N, C, H, W, kh, kw, stride, padding, dilation)
PATCH_GEOMS = [(2, 3, 8, 8, 3, 3, (1, 1), (1, 1), (1, 1)), (1, 2, 16, 8, 3, 3, (2, 2), (1, 1), (1, 1)),
               (2, 4, 12, 4, 1, 1, (1, 1), (0, 0), (1, 1)), (1, 2, 9, 10, 2, 2, (2, 3), (0, 1), (1, 2))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("geom", PATCH_GEOMS, ids=[f"g{i}" for i in range(len(PATCH_GEOMS))])
def test_patch_order_is_a_row_permutation_and_col2im_its_adjoint(geom, device):
    """im2col(patches=True) = the (n, ho, wo) rows permuted into 4 x 4 patch order (exactly), and col2im(patches=True)
    of permuted rows = col2im of the rows in (n, ho, wo) order (exactly: the same values summed in the same order)."""
    N, C, H, W, kh, kw, s, p, d = geom
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, C, H, W, generator=g).to(device)
    rows = im2col(x, (kh, kw), s, p, d)
    Ho = (H + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    Wo = (W + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    assert Ho % 4 == 0 and Wo % 4 == 0
    perm = _patch_perm(N, Ho, Wo).to(device)
    assert torch.equal(im2col(x, (kh, kw), s, p, d, patches=True), rows[perm])
    cols = torch.randn(rows.shape, generator=g).to(device)
    assert torch.equal(col2im(cols[perm], (N, C, H, W), (kh, kw), s, p, d, patches=True),
                       col2im(cols, (N, C, H, W), (kh, kw), s, p, d))


def test_patch_order_needs_sides_that_are_multiples_of_4():
    with pytest.raises(ValueError, match=r"multiples of 4, got 9 x 9"):
        im2col(torch.zeros(1, 1, 9, 9), (3, 3), (1, 1), (1, 1), (1, 1), patches=True)


def test_public_im2col_on_numpy_equals_unfold_and_names_bad_arguments():
    """hot.im2col takes the channels-last map (N, H, W, C) of any DLPack framework: on numpy it equals the unfold
    reference (in (i, j, c) column order), also in patch order; bad arguments are errors naming them."""
    import numpy as np

    import hot

    N, C, H, W = 2, 3, 9, 8
    x = torch.randn(N, C, H, W, generator=torch.Generator().manual_seed(6))
    xh = x.permute(0, 2, 3, 1).contiguous().numpy()
    cols = hot.im2col(xh, 3, stride=2, padding=1)
    assert isinstance(cols, np.ndarray) and cols.shape == (N * 5 * 4, C * 9) and cols.dtype == np.float32
    assert np.array_equal(cols, _unfold_ref(x, (3, 3), (2, 2), (1, 1), (1, 1)).numpy())
    x8 = x[:, :, :8].contiguous()  # an 8 x 8 output map: two 4 x 4 patches a side
    assert np.array_equal(hot.im2col(x8.permute(0, 2, 3, 1).contiguous().numpy(), 3, padding=1, patches=True),
                          im2col(x8, (3, 3), (1, 1), (1, 1), (1, 1), patches=True).numpy())
    with pytest.raises(ValueError, match="im2col: x has 3 dims, expected 4"):
        hot.im2col(xh[0], 3)
    with pytest.raises(ValueError, match="im2col: stride must be >= 1"):
        hot.im2col(xh, 3, stride=0)
    with pytest.raises(ValueError, match="im2col: an input of 9 x 8 with kernel \\(11, 11\\)"):
        hot.im2col(xh, 11)
    with pytest.raises(ValueError, match="im2col: patch order needs"):
        hot.im2col(xh, 3, patches=True)


def test_public_col2im_on_numpy_equals_the_torch_front_and_names_bad_arguments():
    """hot.col2im is the engine's op for any DLPack framework: on numpy it gives the torch front's bytes, and bad
    geometry is an error naming the argument."""
    import numpy as np

    import hot

    N, C, H, W = 2, 3, 9, 8
    g = torch.Generator().manual_seed(5)
    cols = torch.randn(N * 5 * 4, C * 9, generator=g)  # 3x3, stride 2, padding 1 -> 5 x 4 outputs
    out_np = hot.col2im(cols.numpy(), (N, C, H, W), 3, stride=2, padding=1)
    assert isinstance(out_np, np.ndarray) and out_np.shape == (N, C, H, W) and out_np.dtype == np.float32
    assert np.array_equal(out_np, col2im(cols, (N, C, H, W), (3, 3), (2, 2), (1, 1), (1, 1)).numpy())
    with pytest.raises(ValueError, match="col2im: cols has shape"):
        hot.col2im(cols.numpy()[:, :-1], (N, C, H, W), 3, stride=2, padding=1)
    with pytest.raises(ValueError, match="col2im: padding must be >= 0"):
        hot.col2im(cols.numpy(), (N, C, H, W), 3, stride=2, padding=-1)
    with pytest.raises(TypeError, match="col2im: kernel must be an int or a pair of ints"):
        hot.col2im(cols.numpy(), (N, C, H, W), (3, 3, 3))
    with pytest.raises(ValueError, match="col2im: x_shape must be"):
        hot.col2im(cols.numpy(), (N, C, H), 3)


@pytest.mark.parametrize("config", ["default", "paper", "token"])
def test_column_order_permutes_the_gradients_bit_for_bit(config):
    """SPEC §8: hot's (i, j, c) column order and F.unfold's (c, i, j) give the same g_x columns, g_w and g_b, permuted,
    bit for bit (a common column permutation changes no product, scale or random number)."""
    import hot
    from hot.torch import ops as tops

    cfg = {"default": hot.Config(), "paper": hot.Config.paper(), "token": hot.Config(gx_scale="token")}[config]
    g = torch.Generator().manual_seed(3)
    N, C, H, W, O, k = 2, 5, 9, 7, 12, 3
    x, w = torch.randn(N, C, H, W, generator=g), torch.randn(O, C, k, k, generator=g)
    cols = im2col(x, (k, k), (1, 1), (1, 1), (1, 1))
    L = cols.shape[0]
    gy = torch.randn(L, O, generator=g).numpy()
    a = hot.backward_linear(gy, w.reshape(O, -1).numpy(), _ijc_to_cij(cols, C, (k, k)).contiguous().numpy(),
                            bias=True, config=cfg, seed=7)
    b = hot.backward_linear(gy, tops.conv_weight_cols(w).numpy(), cols.numpy(), bias=True, config=cfg, seed=7)
    assert torch.equal(torch.from_numpy(a[0]), _ijc_to_cij(torch.from_numpy(b[0]), C, (k, k)))
    assert torch.equal(torch.from_numpy(a[1]), tops.conv_weight_from_cols(torch.from_numpy(b[1]), w.shape).reshape(O, -1))
    assert torch.equal(torch.from_numpy(a[2]), torch.from_numpy(b[2]))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), (1, 1, 0), (1, 2, 0)])
def test_conv_input_gradient_keeps_the_network_layout(channels_last, kernel, stride, padding):
    """g_x comes back in the network's layout (its g_y's): the engine's col2im writes a channels-last map, which a
    channels-last network gets as it is and an NCHW one transposed (hot::transpose); a pointwise conv's pixel rows go
    back the same way, at stride 2 onto a zero map of that layout. The values are the same either way (round-to-nearest:
    no per-call random bits)."""
    import hot
    import hot.torch as ht

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, kernel, stride=stride, padding=padding))
    ht.convert(model, hot.Config(rounding="nearest"))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x0, g0 = torch.randn(2, 4, 8, 8), None
    grads = {}
    for f in (torch.contiguous_format, fmt):
        m = model.to(memory_format=f)
        leaf = x0.clone(memory_format=f).requires_grad_(True)
        x = leaf * 1.0  # not a leaf: its hook sees g_x as the conv's backward returns it (a leaf's .grad is restrided)
        seen = []
        x.register_hook(seen.append)
        y = m(x)
        if g0 is None:
            g0 = torch.randn(y.shape)
        y.backward(g0.to(memory_format=f))
        assert seen[0].is_contiguous(memory_format=f)
        grads[f] = seen[0]
    assert torch.equal(grads[torch.contiguous_format], grads[fmt])


@pytest.mark.parametrize("patches", [False, True])
def test_public_compress_columns_equals_compress_activation_of_the_columns(patches):
    """hot.compress_columns (SPEC §8) forms the ABC buffer of im2col(Q) from the int8 map Q without the columns: the
    same bytes and scale as hot.compress_activation of the columns, on numpy; bad arguments name themselves."""
    import numpy as np

    import hot

    rng = np.random.default_rng(4)
    q = rng.integers(-127, 128, size=(2, 8, 8, 5), dtype=np.int8)  # (N, H, W, C)
    for rank in (8, 16):
        cfg = hot.Config(rank=rank)
        got = hot.compress_columns(q, 3, padding=1, patches=patches, config=cfg)
        cols = hot.im2col(q.astype(np.float32), 3, padding=1, patches=patches)
        want = hot.compress_activation(cols, config=cfg)
        assert got.shape == want.shape == (2 * 64, 45) and got.rank == rank
        assert np.array_equal(got.q, want.q) and np.array_equal(got.scale, want.scale)
    with pytest.raises(TypeError, match="compress_columns: q_map has dtype float32, expected int8"):
        hot.compress_columns(q.astype(np.float32), 3)
    with pytest.raises(ValueError, match="compress_columns: q_map has 3 dims, expected 4"):
        hot.compress_columns(q[0], 3)


def test_column_codes_are_the_transposed_integer_columns():
    """hot.column_codes (SPEC §4, §8): the im2col columns of the int8 map's integers as they are, transposed, zero
    past N*Ho*Wo up to padded_k, with the map's scale, as a rank-16 SavedActivation of codes; bad maps are refused by
    name."""
    import numpy as np

    import hot

    rng = np.random.default_rng(5)
    q = rng.integers(-128, 128, size=(2, 5, 7, 3), dtype=np.int8)  # (N, H, W, C); L = 2 * 3 * 4 = 24 at stride 2
    s = np.array([0.25], dtype=np.float32)
    got = hot.column_codes(q, s, 3, stride=2, padding=1)
    cols = hot.im2col(q.astype(np.float32), 3, stride=2, padding=1)
    assert got.codes and got.rank == 16 and got.shape == (24, 27) and got.q.shape == (27, 32)
    assert np.array_equal(got.q[:, :24], cols.T.astype(np.int8)) and not got.q[:, 24:].any()
    assert got.scale is s and "codes" in repr(got)
    with pytest.raises(TypeError, match="column_codes: q_map has dtype float32, expected int8"):
        hot.column_codes(q.astype(np.float32), s, 3)
    with pytest.raises(ValueError, match="column_codes: q_map has 3 dims, expected 4"):
        hot.column_codes(q[0], s, 3)


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_weight_gradient_from_the_codes_is_the_linear_backward_of_the_column_codes(channels_last):
    """At the default (rank 16, 8-bit g_x per tensor) the converted conv's g_w (SPEC §4 "g_w from G~'s codes", §8) is
    hot.backward_linear's g_w over its g_y rows with the codes of the kept int8 map's columns (hot.column_codes, the
    map's scale applied by the engine), with the layer's seed, rounded once from float32 to the gradient's dtype; and it
    is within a few percent of exact's (G~ and the map quantised to 8 bits)."""
    import hot
    import hot.torch as ht
    from hot.torch import ops as tops

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(5, 24, 3, padding=1, bias=False))  # O = 24: Hadamard block 8
    ref = nn.Conv2d(5, 24, 3, padding=1, bias=False)
    ref.load_state_dict(model[0].state_dict())
    ht.convert(model)
    conv = model[0]
    assert hot._api.gw_from_codes(conv.hot_config)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 5, 8, 8).to(memory_format=fmt)
    gy = torch.randn(2, 24, 8, 8)
    torch.manual_seed(11)
    model(x.requires_grad_(True)).backward(gy)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # the seed the layer drew (one int64 draw per forward)
    q, s = hot.quantize(x.detach().permute(0, 2, 3, 1).reshape(-1, 5), bits=8, scale="tensor", rounding="nearest")
    saved = hot.column_codes(q.view(2, 8, 8, 5), s, 3, padding=1)
    assert saved.codes and saved.rank == 16 and saved.shape == (128, 45) and tuple(saved.q.shape) == (45, 128)
    g = tops._pixel_rows(gy, (1, 1), False).contiguous()
    _, gw, _ = hot.backward_linear(g, tops.conv_weight_cols(conv.weight.detach()), saved, config=conv.hot_config,
                                   seed=seed)
    assert gw.dtype == torch.float32
    assert torch.equal(conv.weight.grad, tops.conv_weight_from_cols(gw, conv.weight.shape))
    ref(x.detach()).backward(gy)
    err = (conv.weight.grad - ref.weight.grad).norm() / ref.weight.grad.norm()
    assert err < 0.05, float(err)


def test_activation_codes_are_the_transposed_quantisation():
    """hot.activation_codes (SPEC §2 "codes"): x's per-tensor round-to-nearest int8 codes (hot.quantize's, bit for
    bit) transposed, zero past L up to padded_k, with their scale, as a rank-16 SavedActivation of codes."""
    import numpy as np

    import hot

    x = np.random.default_rng(6).standard_normal((3, 7, 5)).astype(np.float32)  # L = 21
    got = hot.activation_codes(x)
    q, s = hot.quantize(x.reshape(21, 5), bits=8, scale="tensor", rounding="nearest")
    assert got.codes and got.rank == 16 and got.shape == (3, 7, 5) and got.q.shape == (5, 32)
    assert np.array_equal(got.q[:, :21], q.T) and not got.q[:, 21:].any()
    assert got.scale.tobytes() == s.tobytes() and "codes" in repr(got)
    with pytest.raises(TypeError, match="activation_codes: x has dtype int8"):
        hot.activation_codes(q)


@pytest.mark.parametrize("stride,channels_last", [(1, False), (1, True), (2, True)])
def test_pointwise_conv_weight_gradient_from_the_codes_of_its_pixel_rows(stride, channels_last):
    """At the default a pointwise conv keeps the codes of the pixel rows it reads (hot.activation_codes) and its g_w is
    hot.backward_linear's over them (g_w from G~'s codes, SPEC §4) with the layer's seed, rounded once from float32;
    within a few percent of exact's."""
    import hot
    import hot.torch as ht
    from hot.torch import ops as tops

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(6, 24, 1, stride=stride, bias=False))
    ref = nn.Conv2d(6, 24, 1, stride=stride, bias=False)
    ref.load_state_dict(model[0].state_dict())
    ht.convert(model)
    conv = model[0]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 6, 8, 8).to(memory_format=fmt)
    gy = torch.randn(2, 24, 8 // stride, 8 // stride)
    torch.manual_seed(11)
    model(x.requires_grad_(True)).backward(gy)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**62, (1,)).item())
    rows = tops._pixel_rows(x.detach(), (stride, stride), False).contiguous()
    saved = hot.activation_codes(rows)
    g = tops._pixel_rows(gy, (1, 1), False).contiguous()
    gx, gw, _ = hot.backward_linear(g, conv.weight.detach().reshape(24, 6), saved, config=conv.hot_config, seed=seed)
    assert gw.dtype == torch.float32
    assert torch.equal(conv.weight.grad, gw.reshape(conv.weight.shape))
    assert torch.equal(x.grad, tops._pixel_unrows(gx, x.shape, (stride, stride), 8 // stride, 8 // stride, False))
    ref(x.detach()).backward(gy)
    err = (conv.weight.grad - ref.weight.grad).norm() / ref.weight.grad.norm()
    assert err < 0.05, float(err)


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_weight_gradient_is_the_linear_backward_of_the_integer_columns(channels_last):
    """Below full rank (the paper's rank 8) the converted conv's g_w (SPEC §8) is the map's scale times
    hot.backward_linear's g_w over the columns of the kept int8 map's integers (float32, rounded once to the gradient's
    dtype), with the layer's seed: the engine's compress_columns gives the ABC buffer those raw columns would get (one
    scale, no chunking at this size)."""
    import hot
    import hot.torch as ht
    from hot.torch import ops as tops

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(5, 6, 3, padding=1, bias=False))
    ht.convert(model, hot.Config(rank=8))
    conv = model[0]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 5, 8, 8).to(memory_format=fmt)
    gy = torch.randn(2, 6, 8, 8)
    torch.manual_seed(11)
    y = model(x.requires_grad_(True))
    y.backward(gy)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # the seed the layer drew (one int64 draw per forward)
    q, s = hot.quantize(x.detach().permute(0, 2, 3, 1).reshape(-1, 5), bits=8, scale="tensor", rounding="nearest")
    patches = tops.conv_patch_rows(8, 8, conv.hot_config)
    cols = im2col(q.view(2, 8, 8, 5).permute(0, 3, 1, 2).float(), (3, 3), (1, 1), (1, 1), (1, 1), patches)
    g = tops._pixel_rows(gy, (1, 1), patches).contiguous()
    _, gw, _ = hot.backward_linear(g, tops.conv_weight_cols(conv.weight.detach()), cols, config=conv.hot_config,
                                   seed=seed)
    assert torch.equal(conv.weight.grad, tops.conv_weight_from_cols(gw * s, conv.weight.shape))


@pytest.mark.parametrize("stride,dilation", [(1, 1), (1, 2), (2, 1)])
def test_conv_input_gradient_is_the_transposed_convolution_of_the_codes(stride, dilation):
    """SPEC §8: at stride 1 a converted conv's g_x is the transposed convolution of the int8 codes of G~ (g_y's rows
    times blockdiag(H_b), per tensor) with those of W~ (H_b W), one exact integer sum per element scaled once by
    s_g s_w / b: float64's conv_transpose2d of the integer codes, scaled, bounds it to a few fp32 roundings. At stride
    2 g_x is col2im of the g_x columns (the sums of 9 rounded terms): the same bound does not hold there, a looser one
    does."""
    import hot
    import hot.torch as ht
    import torch.nn.functional as F

    torch.manual_seed(0)
    N, C, H, W, O, k, p = 2, 8, 10, 9, 24, 3, dilation  # O = 24: Hadamard block 8
    model = nn.Sequential(nn.Conv2d(C, O, k, stride=stride, padding=p, dilation=dilation, bias=False))
    cfg = hot.Config(rounding="nearest")  # no per-call random bits: the codes follow from g_y alone
    ht.convert(model, cfg)
    x = torch.randn(N, C, H, W, requires_grad=True)
    y = model(x)
    gy = torch.randn(y.shape)
    y.backward(gy)
    Ho, Wo = y.shape[2], y.shape[3]
    b = 8
    g_rows = gy.permute(0, 2, 3, 1).reshape(-1, O)
    qg, sg = hot.quantize(hot.hadamard_transform(g_rows, block=b, axis=1), bits=8, rounding="nearest")
    w = model[0].weight.detach()  # (O, C, k, k)
    qw, sw = hot.quantize(hot.hadamard_transform(w.reshape(O, -1), block=b, axis=0), bits=8, rounding="nearest")
    codes_g = qg.double().reshape(N, Ho, Wo, O).permute(0, 3, 1, 2)
    codes_w = qw.double().reshape(O, C, k, k)
    sums = F.conv_transpose2d(codes_g, codes_w, stride=stride, padding=p, dilation=dilation,
                              output_padding=tuple(n - ((m - 1) * stride - 2 * p + dilation * (k - 1) + 1)
                                                   for n, m in ((H, Ho), (W, Wo))))
    want = sums * (float(sg[0]) * float(sw[0]) / b)
    err = (x.grad.double() - want).abs()
    if stride == 1:
        assert torch.all(err <= 8 * 2.0 ** -24 * want.abs() + 1e-30)
    else:
        assert torch.all(err <= 2.0 ** -18 * want.abs().max())
