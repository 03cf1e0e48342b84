"""ISO3_0 / ISO4_0 KV-cache formats: constants and pure-torch references (specs/iso_kv.md).

Each 128-value block is normalised, rotated by a fixed unit quaternion per 4-D group, snapped
to Lloyd-Max centroids and stored with one fp16 "corrected norm". `quantize_ref` /
`dequantize_ref` follow the C reference's operation order (sequential fp32 sums, no FMA): bit
for bit on every golden row. `decode_attention_ref` is the attention the kernels run in the
rotated space (§6.5)."""

from __future__ import annotations

import torch

BLOCK = 128
BLOCK_BYTES = {"iso3": 50, "iso4": 68}
FORMATS = tuple(BLOCK_BYTES)

# Set A quaternions (w, x, y, z), one per 4-D group of a 128-block (§2.1).
QUATS: tuple[tuple[float, float, float, float], ...] = (
    (0.5765609741, 0.4450169504, 0.2695076466, -0.6300023794),
    (0.3176580369, -0.5780548453, -0.0201656222, -0.7513582706),
    (-0.3234235942, 0.7089627385, -0.1687686443, -0.6035611629),
    (-0.5127438903, -0.3940812945, -0.5415957570, 0.5370919704),
    (0.9233905673, -0.0897334740, -0.2796611190, 0.2471584976),
    (-0.3323571086, 0.4727236331, 0.3510629535, 0.7367672324),
    (0.5468608141, 0.5542563796, 0.2609911859, 0.5706370473),
    (-0.2500519454, 0.0450818054, -0.2715902030, 0.9282674193),
    (-0.5812215805, -0.3657043576, -0.0937586129, 0.7208684087),
    (0.3228830695, -0.4298477769, 0.3095585108, -0.7843156457),
    (-0.7299832702, 0.4666220546, -0.4123268127, -0.2817355990),
    (-0.4535493255, 0.7556306720, -0.4394895136, -0.1736787707),
    (-0.7338157296, -0.5284956098, 0.0626545250, 0.4222335219),
    (-0.2884652913, 0.7042509317, -0.4811822474, -0.4350655377),
    (-0.9000198841, 0.0230921544, -0.0407132693, 0.4333281815),
    (-0.0377033800, 0.7110687494, -0.4566248953, 0.5333415866),
    (0.5104404092, 0.3024962246, 0.7834537029, 0.1847889870),
    (0.2033989877, -0.1157865301, -0.6187923551, 0.7498788238),
    (-0.2462528497, 0.7490812540, 0.0809760988, 0.6096553802),
    (0.2314069420, -0.2582575679, -0.8879503012, -0.3021556735),
    (0.0072374810, -0.2255804837, -0.8928058147, -0.3898189068),
    (0.3923372924, 0.3838746250, 0.8350352049, 0.0377884321),
    (0.4958070219, -0.3209520578, -0.6994170547, 0.4024685621),
    (-0.7235037088, -0.3477301002, 0.5606835485, 0.2031257302),
    (-0.9383618832, 0.1824720055, 0.2933705449, 0.0107116764),
    (0.4430379272, 0.4032751918, 0.7377059460, -0.3112498820),
    (-0.2075705230, 0.8433781862, 0.4534837306, 0.1999502629),
    (0.1983736306, 0.9533935785, -0.0009816211, -0.2273492515),
    (-0.8834578991, -0.0620501526, -0.3632916510, 0.2892593443),
    (0.7389573455, 0.0927560627, -0.3959124386, 0.5372074246),
    (-0.0156172011, 0.2964956462, 0.1631654203, 0.9408631325),
    (0.7738668919, 0.2402082384, 0.5088164806, 0.2907505929),
)

CENTROIDS: dict[str, tuple[float, ...]] = {
    "iso3": (-0.1906850000, -0.1178320000, -0.0657170000, -0.0214600000,
             0.0214600000, 0.0657170000, 0.1178320000, 0.1906850000),
    "iso4": (-0.1739260000, -0.1171950000, -0.0895270000, -0.0687560000,
             -0.0512620000, -0.0355970000, -0.0209890000, -0.0069380000,
             0.0069380000, 0.0209890000, 0.0355970000, 0.0512620000,
             0.0687560000, 0.0895270000, 0.1171950000, 0.1739260000),
}

_THRESH = torch.tensor(1e-10, dtype=torch.float32).item()  # the fp32 constant 1e-10f


def _check_fmt(fmt: str) -> None:
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unknown ISO format {fmt!r}; expected one of {FORMATS}")


def packed_row_bytes(head_dim: int, fmt: str) -> int:
    """Bytes of one packed head vector: head_dim/128 blocks of 50 (iso3) or 68 (iso4) bytes."""
    _check_fmt(fmt)
    if head_dim <= 0 or head_dim % BLOCK:
        raise ValueError(f"ISO KV needs head_dim % {BLOCK} == 0, got head_dim={head_dim}")
    return head_dim // BLOCK * BLOCK_BYTES[fmt]


def quat_table() -> torch.Tensor:
    """float32 [32, 4] (w, x, y, z)."""
    return torch.tensor(QUATS, dtype=torch.float32)


def centroid_table(fmt: str) -> torch.Tensor:
    _check_fmt(fmt)
    return torch.tensor(CENTROIDS[fmt], dtype=torch.float32)


def _rotate(v: torch.Tensor, conj: bool) -> torch.Tensor:
    """Left quaternion product per 4-D group, left to right, one rounding per op (no FMA).

    v: float32 [..., 128] -> [..., 128]. conj=True applies the inverse rotation (§2).
    """
    q = quat_table()
    qw, qx, qy, qz = q[:, 0], q[:, 1], q[:, 2], q[:, 3]
    if conj:
        qx, qy, qz = -qx, -qy, -qz
    g = v.reshape(*v.shape[:-1], 32, 4)
    v0, v1, v2, v3 = g[..., 0], g[..., 1], g[..., 2], g[..., 3]
    r0 = qw * v0 - qx * v1 - qy * v2 - qz * v3
    r1 = qw * v1 + qx * v0 + qy * v3 - qz * v2
    r2 = qw * v2 - qx * v3 + qy * v0 + qz * v1
    r3 = qw * v3 + qx * v2 - qy * v1 + qz * v0
    return torch.stack((r0, r1, r2, r3), dim=-1).reshape(v.shape)


def rotate_ref(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The rotation (forward: of queries; `inverse`: back from the rotated space) of every
    128-block of x (float32 [..., D])."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    return _rotate(blocks, conj=inverse).reshape(x.shape)


def _seq_sum_sq(v: torch.Tensor) -> torch.Tensor:
    """Sequential fp32 sum of squares over the last dim of [R, 128] (§4.1 steps 1 and 6)."""
    acc = torch.zeros(v.shape[0], dtype=torch.float32)
    for j in range(v.shape[1]):
        col = v[:, j]
        acc = acc + col * col
    return acc


def _quantize_blocks(xb: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks [R, 128] -> (indices int64 [R, 128], corrected norms float32 [R])."""
    grp_norm = torch.sqrt(_seq_sum_sq(xb))
    inv = torch.where(grp_norm > _THRESH, 1.0 / grp_norm, torch.zeros_like(grp_norm))
    v = xb * inv[:, None]
    r = _rotate(v, conj=False)  # [R, 128]
    cent = centroid_table(fmt)
    best = (r - cent[0]).abs()
    idx = torch.zeros(r.shape, dtype=torch.int64)
    for i in range(1, cent.numel()):
        dist = (r - cent[i]).abs()
        better = dist < best
        idx = torch.where(better, i, idx)
        best = torch.where(better, dist, best)
    recon = torch.sqrt(_seq_sum_sq(cent[idx]))
    return idx, torch.where(recon > _THRESH, grp_norm / recon, grp_norm)


def quantize_ref(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize float32 x [..., D] (D % 128 == 0) to packed uint8 [..., D//128*block_bytes].

    Strict: matches the C reference bit for bit (sequential sums, no FMA). Runs on CPU.
    """
    d = x.shape[-1]
    packed_row_bytes(d, fmt)  # (checks the format and head_dim)
    lead = x.shape[:-1]
    xb = x.detach().to("cpu", torch.float32).reshape(-1, BLOCK)  # [R, 128]
    idx, corrected = _quantize_blocks(xb, fmt)
    norm_bytes = corrected.half().view(torch.uint8).reshape(-1, 2)  # little-endian
    if fmt == "iso3":
        low = (idx & 3).reshape(-1, 32, 4)
        qs = low[..., 0] | low[..., 1] << 2 | low[..., 2] << 4 | low[..., 3] << 6
        hi = ((idx >> 2) & 1).reshape(-1, 16, 8)
        signs = sum(hi[..., k] << k for k in range(8))
        out = torch.cat([norm_bytes, qs.to(torch.uint8), signs.to(torch.uint8)], dim=1)
    else:
        pair = idx.reshape(-1, 64, 2)
        qs = pair[..., 0] | pair[..., 1] << 4
        rnorm = torch.zeros(idx.shape[0], 2, dtype=torch.uint8)
        out = torch.cat([norm_bytes, rnorm, qs.to(torch.uint8)], dim=1)
    return out.reshape(*lead, d // BLOCK * BLOCK_BYTES[fmt])


def unpack_ref(packed: torch.Tensor, fmt: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split packed rows [..., row_bytes] into (norms float32 [..., nb], centroid values
    float32 [..., nb, 128]); the centroid values are in the rotated space, unscaled."""
    rb = packed_row_bytes(head_dim, fmt)
    if packed.shape[-1] != rb or packed.dtype != torch.uint8:
        raise ValueError(f"expected uint8 [..., {rb}] for {fmt} head_dim={head_dim}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    nb = head_dim // BLOCK
    lead = packed.shape[:-1]
    blk = packed.to("cpu").reshape(-1, BLOCK_BYTES[fmt]).to(torch.int64)  # [R, bytes]
    norms = blk[:, :2].to(torch.uint8).contiguous().view(torch.float16).float()[:, 0]
    shifts8 = torch.arange(8)
    if fmt == "iso3":
        low = (blk[:, 2:34, None] >> (2 * torch.arange(4))) & 3  # [R, 32, 4]
        hi = (blk[:, 34:50, None] >> shifts8) & 1  # [R, 16, 8]
        idx = low.reshape(-1, BLOCK) | hi.reshape(-1, BLOCK) << 2
    else:
        idx = ((blk[:, 4:68, None] >> torch.tensor([0, 4])) & 15).reshape(-1, BLOCK)
    cvals = centroid_table(fmt)[idx]
    return norms.reshape(*lead, nb), cvals.reshape(*lead, nb, BLOCK)


def dequantize_ref(packed: torch.Tensor, fmt: str, head_dim: int) -> torch.Tensor:
    """Packed uint8 [..., row_bytes] -> float32 [..., head_dim], bit-exact with the C reference."""
    norms, cvals = unpack_ref(packed, fmt, head_dim)
    y = _rotate(cvals, conj=True) * norms[..., None]
    return y.reshape(*packed.shape[:-1], head_dim)


def gather_rows(cache: torch.Tensor, page_ids: torch.Tensor, page_size: int,
                 n: int) -> torch.Tensor:
    """Rows of the first n tokens of a sequence from cache [slots, ...] via its page ids."""
    t = torch.arange(n, device=cache.device)
    slots = page_ids.to(cache.device).long()[t // page_size] * page_size + t % page_size
    return cache[slots]


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                         fmt: str, scale: float) -> torch.Tensor:
    """One query q [B, Hq, D] per sequence over its packed K/V (uint8 [slots, Hkv, row_bytes],
    slot = page * page_size + offset; page_table [B, P], seq_lens [B] >= 1) in the rotated
    space (§6.5). Returns float32 [B, Hq, D] on the CPU."""
    b_count, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    nb = d // BLOCK
    out = torch.empty(b_count, hq, d, dtype=torch.float32)
    q_rot = rotate_ref(q.float().cpu()).reshape(b_count, hq, nb, BLOCK)  # [B, Hq, nb, 128]
    for b in range(b_count):
        n = int(seq_lens[b])
        kn, kc = unpack_ref(gather_rows(k_cache, page_table[b], page_size, n), fmt, d)
        vn, vc = unpack_ref(gather_rows(v_cache, page_table[b], page_size, n), fmt, d)
        # kn [T, Hkv, nb], kc [T, Hkv, nb, 128] -> expand to the query heads
        kn, kc = kn.repeat_interleave(group, 1), kc.repeat_interleave(group, 1)
        vn, vc = vn.repeat_interleave(group, 1), vc.repeat_interleave(group, 1)
        dots = (kc * q_rot[b][None]).sum(-1)  # [T, Hq, nb]
        scores = (dots * kn).sum(-1) * scale  # [T, Hq]
        p = torch.softmax(scores, dim=0)
        acc = (p[:, :, None, None] * vn[..., None] * vc).sum(0)  # [Hq, nb, 128], rotated
        out[b] = rotate_ref(acc.reshape(hq, d), inverse=True)
    return out


def attention_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                     scale: float) -> torch.Tensor:
    """fp32 causal attention of one sequence's new queries: q [n, Hq, D] at positions
    prefix_len..prefix_len+n-1 over k, v [prefix_len+n, Hkv, D]. Returns float32 [n, Hq, D]."""
    n, hq, _ = q.shape
    total = k.shape[0]
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, T, D]
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    pos = torch.arange(n, device=q.device)[:, None] + prefix_len
    mask = torch.arange(total, device=q.device)[None, :] <= pos  # [n, T]
    s = (qf @ kf.transpose(1, 2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).transpose(0, 1)
